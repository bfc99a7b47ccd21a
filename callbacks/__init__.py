"""Lightning callbacks for instruction tuning, installed as ``lit_instruct.callbacks``."""
