"""Hand-made run summaries, as `ablate.summarize_run` gives them, for the report's tests."""


def run_summary(
  variant: str,
  seed: int,
  curve: dict,
  *,
  g: int = 8,
  all_equal_frac: float | None = None,  # as summarize_run gives a run that logged none
  zero_frac: float = 0.5,
  entropy_final: float = 0.3,
  grad_norm: float = 1.0,
  **extra,
) -> dict:
  """The summary of the run of `variant` at G = `g` and `seed` on clusters easy and hard, whose
  held-out accuracies are `curve` ({"step": [...], "all": [...], "easy": [...], "hard": [...]});
  `extra` adds entries (wall_s)."""
  return {
    "variant": variant,
    "group_size": g,
    "seed": seed,
    "name": f"{variant}_G{g}_s{seed}",
    "clusters": ["easy", "hard"],
    "curve": curve,
    "all_equal_frac": all_equal_frac,
    "zero_frac": zero_frac,
    "entropy_final": entropy_final,
    "grad_norm": grad_norm,
    "shrinkage": None,
    **extra,
  }
