"""Lines per family module: all lines, code lines (not blank, not a comment) and logic lines (code, not docstring).

    python scripts/family_lines.py [--json out.json] [dir]

What docs/adding-a-family.md's before/after table counts (the seam and the kit modules are listed apart).
"""
from __future__ import annotations

import argparse
import ast
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def count(path: pathlib.Path) -> tuple[int, int, int]:
    """(all lines, code lines, logic lines) of one module."""
    text = path.read_text()
    lines = text.splitlines()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = [n for n, line in enumerate(lines, 1) if line.strip() and not line.strip().startswith("#")]
    return len(lines), len(code), sum(1 for n in code if n not in docstrings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default=str(ROOT / "parallel_runtime" / "models"))
    parser.add_argument("--json")
    args = parser.parse_args()
    models = pathlib.Path(args.dir)
    rows = {f"families/{p.name}": count(p) for p in sorted((models / "families").glob("*.py"))
            if p.name != "__init__.py"}
    rows.update({p.name: count(p) for p in sorted(models.glob("*.py")) if p.name != "__init__.py"})
    print(f"{'module':34} {'lines':>6} {'code':>6} {'logic':>6}")
    for name, (lines, code, logic) in rows.items():
        print(f"{name:34} {lines:6d} {code:6d} {logic:6d}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({k: dict(zip(("lines", "code", "logic"), v)) for k, v in rows.items()},
                                                      indent=1))


if __name__ == "__main__":
    main()
