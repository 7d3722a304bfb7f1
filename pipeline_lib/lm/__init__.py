"""The workload: a Transformer language model on WikiText-2, trained through a pipeline.

Nothing in the core imports this package; it is what the executors are exercised with.

* `model.transformer_lm`: the tutorials' causal Transformer LM as a flat ``nn.Sequential``;
* `tokenizer` and `data`: torchtext's ``basic_english`` and vocabulary, WikiText-2 loading
  (verified download, or ``$PIPELINE_LIB_DATA``), ``batchify`` and ``get_batch``;
* `loops`: token-weighted ``evaluate`` and ``train_epoch``, for a plain model or a pipeline;
* `chunked_loss`: the vocabulary projection and its loss, a slice at a time;
* `multi_device_loss`: the same, rows split over devices (``MultiGPULossCompute``);
* `train`: the ``torchrun -m pipeline_lib.lm.train`` program (multi-process training).
"""
