"""Load suite (DESIGN.md section 8): Locust files `burst.py` and `sustained.py`, the experiment
runner `python -m loadtests.experiment`, and the small pure modules they share."""
