"""What the notebooks use and a pipeline does not need.

* `exercises`: the exercises' checks (`exercise`, `withheld`, `hidden_cases`,
  `ignores_namespace` for old check cells); ``make student`` strips the solutions they
  check;
* `speed`: a measured step taken apart (is the pipeline faster, and why not);
* `timing`: several ways of doing one thing timed in turns, and how busy the machine was (03);
* `checks`: each notebook's exercise checks, one module per notebook (``checks.nb03``);
* `data_parallel`: ``nn.DataParallel`` from its four primitives, on any devices (04);
* `pytorch_schedules`: PyTorch's own schedules as our `Schedule`, to compare (02b, 06);
* `workers`: code that only one notebook's ``torchrun`` workers run (04, 05, 06).

The core (schedules, simulator, stages, executors) imports nothing from here;
`lm.multi_device_loss`, notebook 04's loss, builds on `data_parallel`.
"""
