"""Run a script against the disagg found on PYTHONPATH, not the editable install (A/B runs)."""
import runpy
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
