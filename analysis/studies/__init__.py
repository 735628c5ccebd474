"""Example study files shipped with trainsim (see analysis/study.py for the format)."""
