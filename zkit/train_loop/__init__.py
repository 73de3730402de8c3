"""Built-in plugin: the default answers of the step hooks (one global batch as plain gradient
accumulation, its evaluation, the optimizer step, the gradient norm), registered by
:mod:`zkit.train_loop.plugin`. A plugin that drives its own micro-batches (zkit-pipeline's
schedules) answers ``zkit_train_batch`` before it."""
