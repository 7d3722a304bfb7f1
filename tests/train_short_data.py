"""`python -m pipeline_lib.lm.train` on a training split of 3 batches of random tokens, for
`test_round4.py` (run by torchrun): what --steps beyond the data, and a run that
diverges, do. Arguments go to the program as they are."""
import sys

import torch

from pipeline_lib.lm import train

BATCHES, VOCAB = 3, 20


def short_split(args, rank):
    """Training tokens for ``BATCHES`` batches of ``args.bptt``, validation for one."""
    g = torch.Generator().manual_seed(args.seed)
    return (torch.randint(0, VOCAB, (args.batch, BATCHES * args.bptt + 1), generator=g),
            torch.randint(0, VOCAB, (args.batch, args.bptt + 1), generator=g), VOCAB)


if __name__ == "__main__":
    train._tokens = short_split
    train.main(sys.argv[1:])
