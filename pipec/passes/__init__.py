"""Lowering passes: Program -> Program."""
