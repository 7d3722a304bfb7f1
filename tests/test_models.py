import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline_lib.lm.model import CausalBlock, Decoder, Embedding, transformer_lm

VOCAB = 50
SMALL = dict(d_model=32, nhead=4, d_hid=64, nlayers=3)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return transformer_lm(VOCAB, dropout=0.0, **SMALL)


@pytest.fixture
def ids():
    return torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))


def test_layout_is_embedding_blocks_decoder(model):
    kinds = [type(child) for child in model]
    assert kinds == [Embedding, CausalBlock, CausalBlock, CausalBlock, Decoder]


@torch.no_grad()
def test_changing_a_future_token_leaves_earlier_logits_unchanged(model, ids):
    model.eval()
    k = 7
    changed = ids.clone()
    changed[:, k] = (changed[:, k] + 1) % VOCAB
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :k], after[:, :k], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, k:], after[:, k:])  # later positions do see it


@torch.no_grad()
def test_every_child_maps_one_tensor_to_one_tensor(model, ids):
    model.eval()
    x = ids
    shapes = []
    for child in model:
        x = child(x)
        assert isinstance(x, torch.Tensor)
        shapes.append(tuple(x.shape))
    assert shapes == [(3, 12, 32)] * 4 + [(3, 12, VOCAB)]


@torch.no_grad()
def test_any_split_point_gives_the_same_logits(model, ids):
    full = model(ids)  # train mode, but dropout=0 makes it deterministic
    assert torch.equal(full, model(ids))
    for cut in range(1, len(model)):
        first, second = nn.Sequential(*model[:cut]), nn.Sequential(*model[cut:])
        assert torch.equal(second(first(ids)), full)


def test_dropout_is_active_in_train_mode_only(ids):
    torch.manual_seed(0)
    model = transformer_lm(VOCAB, dropout=0.5, **SMALL)
    assert not torch.equal(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), model(ids))


def test_initialisation(model):
    embedding, decoder = model[0].tokens.weight, model[-1].linear
    assert embedding.abs().max() <= 0.1 and embedding.std() > 0.05  # the tutorial's +-0.1
    bound = 1 / math.sqrt(SMALL["d_model"])  # the decoder's scales with the width
    assert decoder.weight.abs().max() <= bound and decoder.weight.std() > bound / 2
    assert torch.count_nonzero(decoder.bias) == 0


@pytest.mark.parametrize("preset", ["cpu", "tutorial"])
@torch.no_grad()
def test_untrained_loss_is_a_uniform_guess_at_every_width(preset):
    # Only the width sets the decoder's logit scale, so one block at full width is enough
    # to check the 1.4B preset (~0.5 GB here). The tutorial's fixed +-0.1 decoder init
    # gave ~6.5 nats above ln V at width 4096.
    vocab = 2000
    torch.manual_seed(0)
    model = transformer_lm(vocab, preset, nlayers=1, dropout=0.0)
    ids = torch.randint(0, vocab, (4, 35), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).item()
    assert abs(loss - math.log(vocab)) < 0.5, (preset, loss, math.log(vocab))


def test_tutorial_preset_has_the_tutorials_1_4b_parameters():
    vocab, d, hid, layers = 28782, 4096, 4096, 12  # WikiText-2 vocabulary of the tutorial
    with torch.device("meta"):
        model = transformer_lm(vocab, preset="tutorial")
    attention = 4 * d * d + 4 * d  # q, k, v, out projections with biases
    feed_forward = 2 * d * hid + hid + d
    layer_norms = 2 * 2 * d
    expected = vocab * d + layers * (attention + feed_forward + layer_norms) + d * vocab + vocab
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == expected == 1_444_261_998
    assert all(p.is_meta for p in params)  # nothing was allocated


def test_bad_configurations_are_explained():
    with pytest.raises(ValueError, match="Unknown preset 'gpu'"):
        transformer_lm(VOCAB, preset="gpu")
    with pytest.raises(TypeError, match=r"Unknown option\(s\) \['n_layers'\]"):
        transformer_lm(VOCAB, n_layers=2)
    with pytest.raises(TypeError, match=r"layers= takes the indices.*pass nlayers= instead"):
        transformer_lm(VOCAB, layers=2)
    with pytest.raises(ValueError, match="divisible by nhead"):
        transformer_lm(VOCAB, d_model=30, nhead=4)
    model = transformer_lm(VOCAB, max_len=8, **SMALL)
    with pytest.raises(ValueError, match="larger max_len or use a shorter bptt"):
        model(torch.zeros(1, 9, dtype=torch.long))
