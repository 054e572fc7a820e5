"""Downstream evaluation through EleutherAI's lm-evaluation-harness, on a run folder or a model directory.

    harness.py          import lm-eval on demand (one line when it is missing or too old)
    tasks.py            task names (nearest names for a wrong one), local task folders, their data loaded up front
    target.py           TARGET -> the model in memory: a run's checkpoint consolidated (LoRA merged), or a directory
    lm.py               RankSplitLM: lm-eval's HFLM on that module, its forward passes split over ranks exactly
    runner.py           one evaluation: lm-eval's results dict, its file, table and scores
    partitioned.py      --zero3: a model too large for one device, held as ZeRO-3 partitions over the ranks
    flags.py            the flags every rank reads, and a launched rank's parser
    command.py          `bigtrain eval` in one process (one rank of several under the launcher)
    __main__.py         `python -m bigtrain.eval`: one launched rank
    during_training.py  train.eval_tasks: the tasks at every evaluation of a run, on the engine's module
    bench.py            `python -m bigtrain.eval.bench`: requests/s against lm-eval's own runner

The verb's launch flags and the launch of its ranks are bigtrain/launch/eval.py.

lm-eval is the `[eval]` extra (`pip install 'bigtrain[eval]'`); nothing here imports it at bigtrain's import.
"""
