"""Run benchmarks/engine/bench_variant.py with module knobs set first: knob_run.py NAME mod:attr=literal ..."""
import ast, importlib, runpy, sys
name, *knobs = sys.argv[1:]
for k in knobs:
    target, value = k.split("=", 1)
    mod, attr = target.split(":")
    setattr(importlib.import_module(mod), attr, ast.literal_eval(value))
sys.argv = ["bench_variant.py", name]
runpy.run_path("benchmarks/engine/bench_variant.py", run_name="__main__")
