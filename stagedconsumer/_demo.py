"""``stagedconsumer demo``: placeholder replaced below."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    subparsers.add_parser("demo", help="run the RIP-22 example")
