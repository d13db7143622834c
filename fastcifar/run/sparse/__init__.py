"""Sparse training with fixed masks: what the trainer calls, and the pieces it is made of.

- ``fisher``: per-parameter Fisher scores from per-sample gradients (``torch.func``);
- ``masks``: top-K of the scores, a random mask of the same size, or masks dealt out over ranks;
- ``update``: the masked optimizer (the whole update, or the gradient only);
- ``diffs``: a base model file and one sparse diff per epoch; restore and inspect (``main``);
- ``local_sgd``: ranks train alone and merge their (sparse) changes every H steps.

``run.SparseRun`` ties them to one run of the trainer, like ``recipe.RunHooks``: ``optimizer`` replaces
the run's optimizer before the step is built; ``epoch_start`` (on the clock: the mask reads
training data, as the whitening init does), ``after_step``, ``epoch_end`` (on the clock: the last
merge of the epoch) and ``epoch_done`` (off the clock, after evaluation: the epoch's diff).
Everything is inert when ``--sparse-mask none`` and neither checkpoints nor local SGD are asked for.
"""
