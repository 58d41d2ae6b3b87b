"""Tools that agents call during rollouts: safe arithmetic (`calculator`) and Python code run in a sandboxed
subprocess (`sandbox`)."""

from laden.tools.calculator import CalculatorError, evaluate_arithmetic
from laden.tools.sandbox import SandboxResult, arun_python, run_python

__all__ = ["CalculatorError", "SandboxResult", "arun_python", "evaluate_arithmetic", "run_python"]
