"""The language reference and the tutorial cannot rot: every example in them is compiled here.

What is checked, by the info string of each fenced block in README.md and docs/language.md, tutorial.md,
testing.md, format.md, torch.md, tuning.md, verification.md, simulator.md and runtime.md (and docs/schedules.md
with its pictures is what scripts/gallery.py writes):

- ```` ```pipe P=4 M=8 [V=2] [NAME=VALUE ...] ````: the block is a whole schedule; `pipec compile` with these
  parameters (names other than P, M, V go to `--set`) succeeds, which includes every verification pass.
- the same with the flag `orders`: the next fenced block (```` ```text ````) is exactly what
  `pipec compile ... --emit orders` prints, and the schedule verifies; with the flag `invalid` as well, the order
  only illustrates the language and must fail verification (exit 1).
- the same with `error=N`: compiling fails with exit code N and the next fenced block is exactly what it prints
  on standard error (the file is written as `example.pipe`, or the name given by `file=`).
- ```` ```pipe excerpt=NAME ````: the lines appear, in order and contiguous, in the bundled `NAME.pipe`.
- ```` ```pipe file=PATH ````: when PATH exists in the repository, the block is that file's whole text; either
  way the file is available, under that path, to the console blocks of the same document.
- ```` ```console ````: lines starting with `$ pipec ` are run (in-process, in a scratch directory holding a copy
  of examples/ and the `file=` blocks) and the lines up to the next `$` are their output (standard output, then
  standard error). A trailing `# exit N` comment gives the expected exit code (default 0). Files the suite keeps
  (tests/bad_schedules) are there too.
- ```` ```python ````: the block runs (in a fresh namespace, in such a scratch directory) without an error.
  With `excerpt=PATH` its lines appear, in order and contiguous, in the repository's PATH instead; with `sketch`
  (a fragment of a larger script, names left to the reader) it must compile and its `pipec` imports must resolve.

And every examples/tutorial/*.pipe that no block shows whole names its parameters in `# check: ARGS` lines; `pipec
check FILE ARGS` passes.

After a deliberate change to an error message or an output, refresh every shown output with
`python tests/docs/test_docs.py --update` and review the diff.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # as conftest.py does: run as a script too

import pytest
from cli_capture import run_main
from paths import ROOT

from pipec.library import bundled_source

DOCS = (
    ROOT / "README.md",
    *(
        ROOT / "docs" / name
        for name in (
            "language.md",
            "tutorial.md",
            "testing.md",
            "format.md",
            "torch.md",
            "tuning.md",
            "verification.md",
            "simulator.md",
            "runtime.md",
        )
    ),
)
EXAMPLES = ROOT / "examples" / "tutorial"
BUILTIN = ("P", "M", "V")
_FLAGS = {"P": "-P", "M": "-M", "V": "-V"}


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    attrs: dict[str, str]
    flags: frozenset[str]
    text: str
    body: tuple[int, int]  # the body's line range in the document, 0-based, end exclusive

    @property
    def where(self) -> str:
        return f"{self.doc.name}:{self.line}"


def read_blocks(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)(.*)$", lines[i])
        if not m:
            i += 1
            continue
        words = m[2].split()
        attrs = dict(w.split("=", 1) for w in words if "=" in w)
        flags = frozenset(w for w in words if "=" not in w)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise AssertionError(f"{doc.name}:{i + 1}: unclosed code block")
        text = "".join(line + "\n" for line in lines[i + 1 : end])
        blocks.append(Block(doc, i + 1, m[1], attrs, flags, text, (i + 1, end)))
        i = end + 1
    return blocks


def run_cli(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """`pipec ARGV` in-process, in directory cwd: (exit code, stdout, stderr)."""
    return run_main(argv, cwd)


def _param_args(block: Block) -> list[str]:
    args = []
    for name, value in block.attrs.items():
        if name in BUILTIN:
            args += [_FLAGS[name], value]
        elif name not in ("file", "excerpt", "error"):
            args += ["--set", f"{name}={value}"]
    return args


def _next_block(block: Block) -> Block:
    blocks = read_blocks(block.doc)
    index = next(i for i, b in enumerate(blocks) if b.line == block.line)
    assert index + 1 < len(blocks) and blocks[index + 1].lang == "text", (
        f"{block.where}: the output of this example belongs in the next block, a ```text one"
    )
    return blocks[index + 1]


def _normalize(text: str) -> str:
    return "".join(line.rstrip() + "\n" for line in text.rstrip("\n").splitlines()) if text.strip() else ""


# ---- what each block should show ---------------------------------------------------------------------------------


def expected_pipe_output(block: Block, scratch: Path) -> tuple[Block | None, str]:
    """Check a ```pipe block; return (the output block it is paired with, the actual output) for orders/error."""
    name = Path(block.attrs.get("file", "example.pipe")).name
    (scratch / name).write_text(block.text)
    argv = ["compile", name, *_param_args(block)]
    if "orders" in block.flags:
        code, out, err = run_cli([*argv, "--emit", "orders"], scratch)
        assert code == 0, f"{block.where}: --emit orders failed with exit {code}:\n{err}"
        verified, _, report = run_cli(argv, scratch)
        if "invalid" in block.flags:
            assert verified == 1, f"{block.where}: marked invalid, but it compiles and verifies now"
        else:
            assert verified == 0, f"{block.where}: the order shown does not verify (mark it 'invalid'):\n{report}"
        return _next_block(block), out
    code, out, err = run_cli(argv, scratch)
    if "error" in block.attrs:
        assert code == int(block.attrs["error"]), (
            f"{block.where}: expected exit {block.attrs['error']}, got {code}\n{err}"
        )
        return _next_block(block), err
    assert code == 0, f"{block.where}: the example does not compile and verify (exit {code}):\n{err}"
    return None, ""


def _scratch_with_files(doc_blocks: list[Block], scratch: Path) -> None:
    shutil.copytree(ROOT / "examples", scratch / "examples", dirs_exist_ok=True)
    shutil.copytree(ROOT / "tests" / "bad_schedules", scratch / "tests" / "bad_schedules", dirs_exist_ok=True)
    for b in doc_blocks:
        if b.lang == "pipe" and "file" in b.attrs:
            path = scratch / b.attrs["file"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.text)


@dataclass
class Command:
    argv: list[str]
    exit_code: int
    shown: list[str] = field(default_factory=list)  # the output lines as the document shows them
    line: int = 0  # 0-based line of the `$` in the document


def parse_console(block: Block) -> list[Command]:
    commands: list[Command] = []
    for offset, line in enumerate(block.text.splitlines()):
        if line.startswith("$ "):
            words = shlex.split(line[2:], comments=False)
            exit_code = 0
            if "#" in words:
                comment = words[words.index("#") :]
                words = words[: words.index("#")]
                if len(comment) >= 3 and comment[1] == "exit":
                    exit_code = int(comment[2])
            assert words and words[0] == "pipec", f"{block.where}: only pipec commands can be checked: {line}"
            commands.append(Command(words[1:], exit_code, line=block.body[0] + offset))
        else:
            assert commands, f"{block.where}: output before the first '$ pipec' command"
            commands[-1].shown.append(line)
    return commands


def run_console(block: Block, scratch: Path) -> list[tuple[Command, str]]:
    """Run each command of a console block; returns (command, actual output) and checks exit codes."""
    _scratch_with_files(read_blocks(block.doc), scratch)
    results = []
    for command in parse_console(block):
        code, out, err = run_cli(command.argv, scratch)
        assert code == command.exit_code, (
            f"{block.where}: pipec {shlex.join(command.argv)} exited {code}, the document says {command.exit_code}"
            f"\n{out}{err}"
        )
        results.append((command, out + err))
    return results


# ---- the tests ----------------------------------------------------------------------------------------------------


def _all_blocks() -> list[Block]:
    return [b for doc in DOCS if doc.exists() for b in read_blocks(doc)]


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


PIPE_BLOCKS = [b for b in _all_blocks() if b.lang == "pipe"]
CONSOLE_BLOCKS = [b for b in _all_blocks() if b.lang == "console"]
PYTHON_BLOCKS = [b for b in _all_blocks() if b.lang == "python"]


def test_docs_have_examples() -> None:
    for doc in DOCS:
        assert doc.exists(), f"{doc} is missing"
    assert len(PIPE_BLOCKS) >= 20 and CONSOLE_BLOCKS, "the documents lost their examples"
    assert sorted(EXAMPLES.glob("*.pipe")), "examples/tutorial has no schedules"


@pytest.mark.parametrize("block", PIPE_BLOCKS, ids=_ids(PIPE_BLOCKS))
def test_pipe_block(block: Block, tmp_path: Path) -> None:
    if "excerpt" in block.attrs:
        library = bundled_source(block.attrs["excerpt"]).splitlines()
        shown = block.text.splitlines()
        found = any(
            [s.rstrip() for s in library[i : i + len(shown)]] == [s.rstrip() for s in shown]
            for i in range(len(library) - len(shown) + 1)
        )
        assert found, f"{block.where}: not an excerpt of {block.attrs['excerpt']}.pipe any more"
        return
    if "file" in block.attrs and (ROOT / block.attrs["file"]).exists():
        assert block.text == (ROOT / block.attrs["file"]).read_text(), (
            f"{block.where}: differs from {block.attrs['file']}"
        )
    if not set(block.attrs) & set(BUILTIN):
        assert "file" in block.attrs, f"{block.where}: a pipe block needs parameters (P=.. M=..), excerpt= or file="
        used = any(block.attrs["file"] in " ".join(c.argv) for b in CONSOLE_BLOCKS for c in parse_console(b))
        assert used, f"{block.where}: {block.attrs['file']} is shown but no console block runs it"
        return
    paired, actual = expected_pipe_output(block, tmp_path)
    if paired is not None:
        assert _normalize(actual) == _normalize(paired.text), (
            f"{block.where}: the output shown at {paired.where} is not what pipec prints now:\n{actual}"
        )


@pytest.mark.parametrize("block", CONSOLE_BLOCKS, ids=_ids(CONSOLE_BLOCKS))
def test_console_block(block: Block, tmp_path: Path) -> None:
    for command, actual in run_console(block, tmp_path):
        assert _normalize(actual) == _normalize("\n".join(command.shown)), (
            f"{block.where}: `pipec {shlex.join(command.argv)}` now prints:\n{actual}"
        )


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=_ids(PYTHON_BLOCKS))
def test_python_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if "excerpt" in block.attrs:
        source = [line.rstrip() for line in (ROOT / block.attrs["excerpt"]).read_text().splitlines()]
        shown = [line.rstrip() for line in block.text.splitlines()]
        found = any(source[i : i + len(shown)] == shown for i in range(len(source) - len(shown) + 1))
        assert found, f"{block.where}: not an excerpt of {block.attrs['excerpt']} any more"
        return
    code = compile(block.text, block.where, "exec")
    if "sketch" in block.flags:
        for node in ast.walk(ast.parse(block.text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipec"):
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{block.where}: {node.module} has no {', '.join(missing)}"
        return
    _scratch_with_files(read_blocks(block.doc), tmp_path)
    monkeypatch.chdir(tmp_path)
    exec(code, {"__name__": "__doc_block__"})


# a file a document shows whole (```pipe file=examples/tutorial/NAME```) may go without `# check:` lines: it is
# checked as the document's console blocks run it (first_try.pipe is the tutorial's deliberate mistake, typo.pipe
# its syntax error)
SHOWN_FILES = {ROOT / b.attrs["file"] for b in PIPE_BLOCKS if "file" in b.attrs}
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.pipe"))


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.name for p in EXAMPLE_FILES])
def test_tutorial_example(path: Path) -> None:
    checks = re.findall(r"^# check: (.*)$", path.read_text(), re.MULTILINE)
    if not checks and path in SHOWN_FILES:
        return
    assert checks, f"{path.name}: name the parameters it is checked for in '# check: -P 4 -M 8' lines"
    for args in checks:
        code, out, err = run_cli(["check", str(path), *shlex.split(args)], ROOT)
        assert code == 0, f"{path.name}: pipec check {args} exited {code}\n{out}{err}"


def test_tutorial_1f1b_is_the_library_1f1b() -> None:
    """The tutorial says its 1F1B, and its variant with no extra warm-up, order work as the bundled 1f1b."""
    import pipec

    for p, m in ((1, 1), (3, 2), (4, 8), (5, 7)):
        reference = pipec.load("1f1b", p, m).streams
        assert pipec.load(str(EXAMPLES / "step2_1f1b.pipe"), p, m).streams == reference
        assert pipec.load(str(EXAMPLES / "step3_warmup.pipe"), p, m).streams == reference


def test_the_gallery_is_what_its_script_writes(tmp_path: Path) -> None:
    """docs/schedules.md's figures (and docs/img/*.svg) come from `python scripts/gallery.py`, run here."""
    import subprocess

    subprocess.run([sys.executable, str(ROOT / "scripts" / "gallery.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    assert (tmp_path / "schedules.md").read_text() == (ROOT / "docs" / "schedules.md").read_text(), (
        "docs/schedules.md is stale: run python scripts/gallery.py"
    )
    for picture in sorted((tmp_path / "img").glob("*.svg")):
        assert picture.read_text() == (ROOT / "docs" / "img" / picture.name).read_text(), f"{picture.name} is stale"


# ---- refreshing the shown outputs ---------------------------------------------------------------------------------


def update(doc: Path, scratch: Path) -> int:
    """Rewrite every output block of doc with what pipec prints now. Returns how many blocks changed."""
    replacements: list[tuple[int, int, list[str]]] = []
    for block in read_blocks(doc):
        if block.lang == "pipe" and set(block.attrs) & set(BUILTIN) and "excerpt" not in block.attrs:
            work = scratch / f"pipe{block.line}"
            work.mkdir(parents=True)
            paired, actual = expected_pipe_output(block, work)
            if paired is not None:
                replacements.append((*paired.body, _normalize(actual).splitlines()))
        elif block.lang == "console":
            work = scratch / f"console{block.line}"
            work.mkdir(parents=True)
            for command, actual in run_console(block, work):
                start = command.line + 1
                replacements.append((start, start + len(command.shown), _normalize(actual).splitlines()))
    lines = doc.read_text().splitlines()
    changed = 0
    for start, end, new in sorted(replacements, reverse=True):
        if lines[start:end] != new:
            lines[start:end] = new
            changed += 1
    doc.write_text("\n".join(lines) + "\n")
    return changed


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/docs/test_docs.py --update   (rewrites the outputs shown in docs/*.md)")
    with tempfile.TemporaryDirectory() as scratch:
        for doc in DOCS:
            print(f"{doc.relative_to(ROOT)}: {update(doc, Path(scratch) / doc.stem)} output block(s) changed")
