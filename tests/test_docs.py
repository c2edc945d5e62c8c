"""The README and docs/ as a reader follows them: every relative link lands on a file (and heading) that exists,
every command a page shows runs with the flags it names, the two entry points say what the Makefile does, and the
README's family table names every family the runtime declares.

Commands are read from ```bash / ```sh / ```shell / ```console blocks and from inline code that starts like a
command (`python -m parallel_runtime ...`, `python scripts/...`, `make ...`, or a parallel_runtime subcommand such
as `bench --quick`). Each command's --help is collected once, in one interpreter (importing torch once), and kept
under a digest of the sources, so the whole file takes seconds."""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SUBCOMMANDS = ("demo", "bench", "bench-storage", "bench-vae", "soak")  # parallel_runtime/__main__.py's commands
# The newcomer's path (what it is, two commands, install, swap the loader, pick a strategy, when one GPU is
# faster, the families, where to read more) fits in about 200 lines; reference material belongs in docs/.
README_MAX_LINES = 230


# ---- reading markdown ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def parse(page: Path) -> tuple[list[tuple[int, str]], list[tuple[str, list[tuple[int, str]]]]]:
    """(prose lines, fenced blocks as (language, lines)), each line with its 1-based number."""
    prose, blocks, fence, block = [], [], None, None
    for no, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence is None and m:
            fence, block = m.group(1), (m.group(2).lower(), [])
        elif fence is not None and line.strip().startswith(fence):
            blocks.append(block)
            fence = None
        elif fence is not None:
            block[1].append((no, line))
        else:
            prose.append((no, line))
    return prose, blocks


def strip_code_spans(line: str) -> str:
    return re.sub(r"(`+)(.+?)\1", "", line)


def code_spans(line: str) -> list[str]:
    return [m.group(2).strip() for m in re.finditer(r"(`+)(.+?)\1", line)]


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lower-cased, punctuation other than '-' and '_'
    dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in parse(page)[0]:
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")  # GitHub numbers repeated headings
        out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return frozenset(out)


def links(page: Path) -> list[tuple[int, str]]:
    found = []
    for no, line in parse(page)[0]:
        for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", strip_code_spans(line)):
            found.append((no, m.group(1)))
    return found


def link_problem(page: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ... : not ours to check
        return None
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
    if not dest.is_relative_to(ROOT):
        return f"{target}: points outside the repository"
    if anchor:
        if dest.suffix != ".md":
            return f"{target}: an anchor into a file that is not markdown"
        if anchor not in anchors(dest):
            return f"{target}: {dest.relative_to(ROOT)} has no heading with the anchor #{anchor}"
    return None


# ---- reading commands ----------------------------------------------------------------------------------------

def command_lines(page: Path) -> list[tuple[int, str]]:
    """Shell lines of the page's shell blocks (continuations joined, console prompts stripped), then inline code
    that reads as one of our commands."""
    prose, blocks = parse(page)
    out = []
    for lang, lines in blocks:
        if lang not in SHELL_LANGS:
            continue
        pending, start = "", 0
        for no, line in lines:
            if lang == "console":
                if not line.startswith(("$ ", "> ")) and not pending:
                    continue  # output, not a command
                line = line[2:] if line.startswith(("$ ", "> ")) else line
            start = start or no
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((start, pending + line))
            pending, start = "", 0
    for no, line in prose:
        for span in code_spans(line):
            words = span.split()
            if not words:
                continue
            ours = (span.startswith(("python -m parallel_runtime", "python scripts/", "make "))
                    or (words[0] in SUBCOMMANDS and len(words) > 1 and words[1].startswith("--")))
            if ours:
                # an inline synopsis: `demo [--devices cpu:4] [--prompt WORDS]`; the brackets mark options
                text = re.sub(r"[\[\]]", " ", span)
                out.append((no, text if not text.split()[0] in SUBCOMMANDS else "python -m parallel_runtime " + text))
    return out


def split_commands(line: str) -> list[list[str]]:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose-like text: its flags still count
        words = line.split("#")[0].split()
    commands, current = [], []
    for w in words + [";"]:
        if w in ("&&", "||", ";", "|"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(w)
    return commands


def is_python(word: str) -> bool:
    return re.fullmatch(r"python(3(\.\d+)?)?(\.exe)?", os.path.basename(word.replace("\\", "/"))) is not None


def identify(words: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    """(what runs, its arguments) for a command of ours: ("make",), ("module", name, sub?) or ("script", path)."""
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words:
        return None
    if words[0] == "make":
        return ("make",), words[1:]
    if words[0].startswith("scripts/") and words[0].endswith(".py"):
        return ("script", words[0]), words[1:]
    if not is_python(words[0]) or len(words) < 2:
        return None
    if words[1] == "-m" and len(words) > 2 and words[2].split(".")[0] == "parallel_runtime":
        if words[2] == "parallel_runtime":
            sub = words[3] if len(words) > 3 and not words[3].startswith("-") else ""
            return ("module", "parallel_runtime", sub), words[4 if sub else 3:]
        return ("module", words[2]), words[3:]
    if words[1].startswith("scripts/") and words[1].endswith(".py"):
        return ("script", words[1]), words[2:]
    return None


def our_commands() -> list[tuple[str, tuple[str, ...], list[str]]]:
    """(where, what runs, arguments) for every command of ours on every page."""
    out = []
    for page in PAGES:
        for no, line in command_lines(page):
            for words in split_commands(line):
                found = identify(words)
                if found:
                    out.append((f"{page.relative_to(ROOT)}:{no}", *found))
    return out


HELP_COLLECTOR = r"""
import contextlib, io, json, os, runpy, sys
out = {}
for key in json.loads(sys.argv[1]):
    buf, code = io.StringIO(), 0
    if key[0] == "script":
        sys.argv = [key[1], "--help"]
        sys.path.insert(0, os.path.dirname(os.path.abspath(key[1])))
    else:
        sys.argv = [key[1]] + [a for a in key[2:] if a] + ["--help"]
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            if key[0] == "script":
                runpy.run_path(key[1], run_name="__main__")
            else:
                runpy.run_module(key[1], run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception as e:
            code, _ = 1, buf.write(f"{type(e).__name__}: {e}")
    out[json.dumps(key)] = {"code": code, "text": buf.getvalue()}
print(json.dumps(out))
"""


def sources_digest(keys: list) -> str:
    """What the help texts depend on: the commands asked for, every source file that builds a parser, Python."""
    h = hashlib.sha256(json.dumps([keys, sys.version, sys.executable]).encode())
    for path in sorted([*(ROOT / "parallel_runtime").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:20]


@functools.lru_cache(maxsize=None)
def help_texts() -> dict[tuple[str, ...], dict]:
    """Each command's --help output and exit status, collected in one interpreter (torch imported once) and kept
    in the temp folder under a digest of the sources, so a rerun on unchanged code reads them back."""
    keys = sorted({what for _, what, _ in our_commands() if what[0] != "make"})
    cache = Path(tempfile.gettempdir()) / f"paradit-docs-help-{sources_digest(keys)}.json"
    try:
        raw = json.loads(cache.read_text())
    except FileNotFoundError:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-c", HELP_COLLECTOR, json.dumps(keys)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        raw = json.loads(proc.stdout.strip().splitlines()[-1])
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(raw))
        os.replace(partial, cache)  # whole or absent, whoever else is writing it
        for stale in cache.parent.glob("paradit-docs-help-*.json"):
            if stale != cache:
                stale.unlink(missing_ok=True)  # written for sources that have changed since
    return {tuple(json.loads(k)): v for k, v in raw.items()}


def make_targets() -> dict[str, list[str]]:
    """Each Makefile target and its recipe lines."""
    targets, current = {}, None
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
        if m:
            current = m.group(1).split()
            for t in current:
                targets[t] = []
        elif line.startswith("\t") and current:
            for t in current:
                targets[t].append(line.strip())
        elif line.strip() and not line.startswith("#"):
            current = None
    return targets


# ---- the tests -----------------------------------------------------------------------------------------------

def test_every_relative_link_resolves():
    problems = []
    for page in PAGES:
        for no, target in links(page):
            why = link_problem(page, target)
            if why:
                problems.append(f"{page.relative_to(ROOT)}:{no}: {why}")
    assert len(PAGES) > 1 and sum(len(links(p)) for p in PAGES) > 20, "no links found: the parser is broken"
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for _, target in links(page):
            path = target.partition("#")[0]
            if not path or re.match(r"^[a-z][a-z0-9+.-]*:", path, re.I):
                continue
            dest = (page.parent / path).resolve()
            if dest.suffix == ".md" and dest.exists() and dest not in reached:
                reached.add(dest)
                todo.append(dest)
    orphans = [str(p.relative_to(ROOT)) for p in PAGES if p.resolve() not in reached]
    assert not orphans, f"pages no link from README.md leads to: {orphans}"


def test_every_command_flag_is_in_its_help():
    commands = our_commands()
    # The README's own commands must be among those read, or the parser has gone blind.
    whats = {what for _, what, _ in commands}
    assert ("make",) in whats and ("module", "parallel_runtime", "bench") in whats, whats
    helps = help_texts()
    problems = []
    for where, what, args in commands:
        if what[0] == "make":
            continue
        shown = " ".join(a for a in what[1:] if a)
        result = helps[what]
        if result["code"] != 0 or "usage" not in result["text"].lower():
            problems.append(f"{where}: `{shown} --help` failed (exit {result['code']}): {result['text'][-300:]}")
            continue
        known = set(re.findall(r"--[A-Za-z0-9][\w-]*", result["text"]))
        for flag in (a.split("=", 1)[0] for a in args if a.startswith("--")):
            if flag not in known:
                problems.append(f"{where}: `{shown}` has no option {flag}")
    assert not problems, "commands the docs show that would not run:\n" + "\n".join(problems)


def test_every_make_target_exists():
    targets = make_targets()
    assert {"demo", "test"} <= targets.keys(), targets.keys()
    missing = [f"{where}: make {t}" for where, what, args in our_commands() if what == ("make",)
               for t in args if not t.startswith("-") and "=" not in t and t not in targets]
    assert not missing, "make targets the docs name that the Makefile lacks:\n" + "\n".join(missing)


def test_readme_entry_points_say_what_the_makefile_runs():
    """`make demo   # sets up .venv, then: python -m parallel_runtime demo (...)`: the comment's command is the
    target's recipe, with the venv's python; and .ci/run runs the README's test command."""
    targets = make_targets()
    said = {}
    for _, lines in parse(README)[1]:
        for _, line in lines:
            m = re.match(r"^make (\w[\w-]*)\s+#.*then: (.+?)(?:\s+\(.*)?$", line)
            if m:
                said[m.group(1)] = m.group(2).strip()
    assert {"demo", "test"} <= said.keys(), said
    for target, command in said.items():
        recipe = [r.replace("$(VPY)", "python").lstrip("@") for r in targets[target]]
        assert command in recipe, f"README says `make {target}` runs `{command}`; the Makefile runs {recipe}"
        assert "$(VENV)/.ready" in (ROOT / "Makefile").read_text().split(f"\n{target}:")[1].splitlines()[0], \
            f"`make {target}` does not set up .venv first"
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M), ".ci/run does not run `make test`"


def declared_family_titles() -> list[str]:
    """The `title` of every family a module under models/families declares (read from the source: no import)."""
    titles = []
    for path in sorted((ROOT / "parallel_runtime" / "models" / "families").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                kw = {k.arg: k.value for k in node.keywords}
                if "name" in kw and isinstance(kw.get("title"), ast.Constant):
                    titles.append(kw["title"].value)
    return titles


def test_readme_family_table_names_every_family():
    """One row per family, each starting with the family's name (its title before any parenthesis)."""
    names = sorted(t.split(" (")[0] for t in declared_family_titles())
    assert len(names) >= 11, names  # Flux.1 ... HunyuanVideo 1.5: the parser must find them all
    prose = [line for _, line in parse(README)[0]]
    start = next((i for i, line in enumerate(prose) if re.match(r"^## Model families\s*$", line)), None)
    assert start is not None, "README.md has no '## Model families' section"
    rows = []
    for line in prose[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not re.match(r"^\|\s*(family\s*\||-)", line):
            rows.append(line.strip("|").split("|")[0].strip())
    # each row's family: the longest name it starts with ("Qwen-Image 2.1" before "Qwen-Image")
    matched = sorted(max((n for n in names if row.startswith(n)), key=len, default=f"<no family: {row}>")
                     for row in rows)
    assert matched == names, f"README's family rows {rows} do not name each family once: {names}"


def test_readme_stays_the_newcomers_path():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"
    headings = [line for line in lines if line.startswith("## ")]
    for needed in ("Install into ComfyUI", "When one GPU is faster", "Model families", "Read more"):
        assert any(needed in h for h in headings), f"README.md lost its '{needed}' section"
    windows = README.read_text(encoding="utf-8").split("### Windows", 1)[1].split("\n## ", 1)[0]
    for fact in ("python_embeded\\python.exe -m pip install -r ComfyUI\\custom_nodes\\ParaDiT\\requirements.txt",
                 ".venv\\Scripts\\python.exe", "127.0.0.1", "NCCL"):
        assert fact in windows, f"README's Windows section lost {fact!r}"
    assert "NCCL_P2P_DISABLE=1" in README.read_text(encoding="utf-8")
    assert "--shm-size=1g" in README.read_text(encoding="utf-8")
