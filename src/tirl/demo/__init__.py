"""The tiny CPU experiment (`tirl demo`) and everything only it uses: synthetic tasks, programmatic
SFT traces and copy drills, and the plots of its report. Nothing outside this package imports it."""

from tirl.demo.checks import DemoShortfall
from tirl.demo.pipeline import DemoError, quick_overrides, real_overrides, run_demo
from tirl.demo.seed_sweep import run_demo_seeds

__all__ = ["DemoError", "DemoShortfall", "quick_overrides", "real_overrides", "run_demo", "run_demo_seeds"]
