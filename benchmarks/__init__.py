"""The benchmark harness (bench.py and its parts, bench_mixer.py, bench_generate.py, profile_step.py): measurements of
the system, apart from the user commands in tools/. docs/benchmarks.md says what each measures and how to read it."""
