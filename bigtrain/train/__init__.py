"""One training job: build steps (`job`), the engine over deepspeed.initialize (`engine`), the step loop
(`loop`), the runner's view of the data (`inputs`), what a run reports (`report`) and its end-of-run sample
(`sample`)."""
