"""The measurements behind `cpumla bench` and the scripts in benchmarks/: the machine's limits (read
bandwidth, FMA and bf16 dot peaks), kernel rates (kernels.py), a model's prefill and decode against
those limits (model.py), and every level checked against the scalar spec (report.py). Nothing here
prints: the CLI renders."""
