"""The tiny CPU experiment (`tirl demo`) and everything only it uses: synthetic tasks, programmatic
SFT traces and copy drills, and the plots of its report. Nothing outside this package imports it."""

from tirl.demo.pipeline import DemoError, run_demo

__all__ = ["DemoError", "run_demo"]
