"""Layer 7 — the `sft` command: one function per verb (train, eval, data, check, plan, recipes, merge, generate,
chat, launch, alpaca) that parses flags and calls the layers below. The entry point is `sft.cli.main:main`.

Owns: argument parsing, logging setup, exit codes (SFTError -> 2 without a traceback unless --debug).
Must not be imported by any other sft package.
"""
