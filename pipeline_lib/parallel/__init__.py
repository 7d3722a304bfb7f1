"""Tensor parallelism, sharded data parallelism (FSDP) and the bytes they move: the two
dimensions a pipeline's mesh adds to its own.

* `block`: the Transformer LM's block laid out so that its heads can be split
  (`ShardableBlock`, `shardable`): same function, masks and state-dict names;
* `by_hand`: Megatron-LM's f and g, column- and row-parallel layers, a block split over
  t ranks with and without sequence parallelism, written out (a teaching module);
* `tensor_parallel`: the same with PyTorch's plans (`parallelize_module` on a
  `DeviceMesh` dimension): what runs;
* `streams`: dropout masks under tensor parallelism (shared where the ranks hold the
  same tensor, their own where each holds a part);
* `fsdp`: `fully_shard` (or, for tensor-parallel weights, `replicate`: DDP's all-reduce) on a
  pipeline stage, its gradients reduced once a step;
* `rank_order`: the ranks of a ``tp × pp × dp`` mesh for a rank order ("tp-dp-pp",
  Megatron-LM's; "tp-pp-dp", Llama 3's) and its `DeviceMesh`;
* `traffic`: the bytes each rank sends, counted in the run, per mesh dimension.
"""
