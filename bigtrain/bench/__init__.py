"""`bigtrain bench`: throughput, MFU and memory of bigtrain against hand-written baselines.

Every configuration runs as a real job, started as `bigtrain train` starts it (2 ranks on a CPU: DeepSpeed's per-node
launcher; one rank: the rank alone). Files:

`cases`      workloads (model + data + batch) and strategies (ZeRO x offload x checkpointing x pipeline)
`hostenv`    the environment every job gets (threads, malloc tunables, core binding) and host facts
`peak`       the bf16 / fp32 matmul peak, measured by concurrent ranks on the same cores
`jobs`       launch one job (bigtrain or a baseline) and read its result
`timers`     DeepSpeed's wall-clock breakdown (forward / backward / step) from a job's log
`baseline`   the one loop the reference baselines share: data, step clock, result file
`baseline_deepspeed`, `baseline_ddp`, `baseline_nanogpt`   what each baseline wraps and steps (launcher scripts)
`rows`       one table row per job: rates, TFLOP/s, MFU, memory, ratios
`table`, `plots`, `doc`   markdown, PNGs, and the generated sections of docs/benchmarks.md
`capacity`   the largest GPT-2 shape that trains, by bisection under a memory watchdog
`sweep`      the short (CI) and full sweeps;  `cli`  the `bigtrain bench` verb
"""
