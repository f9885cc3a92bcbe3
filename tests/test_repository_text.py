"""What the tracked files say: the project speaks of itself (its code, dates, commits, machines),
never of how the work on it was organised; and every link inside the repository's Markdown resolves.

The words looked for are built from pieces below, so that this file does not match itself."""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENDORED = ("prefixkv/server/static/vendor/",)  # third-party files, as their projects ship them
SELF = "tests/test_repository_text.py"  # names what it looks for

WORK_WORD = "sess" + "ion"
ORG_WORDS = re.compile("|".join([WORK_WORD, "hel" + "per"]), re.I)
# the library senses of the first word: aiohttp's and requests' client classes, subprocess's keyword
# for a new process group, pytest's widest fixture scope
LIBRARY_SENSE = re.compile(r"Client%s|requests\.%s|start_new_%s|scope=[\"']%s[\"']"
                           % ("Session", "Session", WORK_WORD, WORK_WORD))
# numbered work periods: spelled ordinals from the eleventh on, and "-16th"-like name parts
ORDINALS = re.compile(r"\b(?:eleven|twelf|thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|"
                      r"twentie|twenty-(?:fir|seco|thi|four|fif|six|seven|eigh|nin))\w*\b", re.I)
NUMBERED_NAME = re.compile(r"[-_]\d+(?:st|nd|rd|th)\b|%s\d" % WORK_WORD, re.I)


def tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


# identifiers that name a library's object or field: aiohttp's ClientSession, vLLM's KV event field
LIBRARY_NAMES = (WORK_WORD, "clientsession", f"{WORK_WORD}_id")


def _text(path: str) -> str | None:
    data = (ROOT / path).read_bytes()
    if b"\0" in data:
        return None  # binary (PNG)
    return data.decode("utf-8", errors="replace")


def _is_python(path: str, text: str) -> bool:
    return path.endswith(".py") or text.startswith("#!") and "python" in text.split("\n", 1)[0]


def _prose(path: str, text: str):
    """(line number, text) of what a reader reads as words: in Python, comments and strings (an
    identifier named after the word holds the library's object, e.g. an aiohttp ClientSession);
    elsewhere every line."""
    if _is_python(path, text):
        try:
            for tok in tokenize.generate_tokens(io.StringIO(text).readline):
                if tok.type == tokenize.NAME and tok.string.lower().strip("_") in LIBRARY_NAMES:
                    continue
                if tok.type == tokenize.STRING and tok.string.strip("'\"") == WORK_WORD:
                    continue  # pytest's scope name as a literal
                if tok.type in (tokenize.NAME, tokenize.STRING, tokenize.COMMENT):
                    yield tok.start[0], tok.string
            return
        except (tokenize.TokenError, SyntaxError):
            pass
    yield from enumerate(text.split("\n"), 1)


def test_the_repository_speaks_of_the_project_only():
    found = []
    for path in tracked():
        if path.startswith(VENDORED) or path == SELF:
            continue
        if NUMBERED_NAME.search(path) or ORG_WORDS.search(path):
            found.append(f"{path}: its name")
        text = _text(path)
        if text is None:
            continue
        for line, words in _prose(path, text):
            words = LIBRARY_SENSE.sub("", words)
            m = ORG_WORDS.search(words) or ORDINALS.search(words)
            if m:
                found.append(f"{path}:{line}: {m.group(0)!r} in {words.strip()[:100]!r}")
    assert not found, "\n".join(found)


def test_the_word_check_catches_what_it_looks_for():
    """The check above, on made-up lines: the library senses pass, the organisational ones do not."""
    def flagged(path: str, text: str) -> bool:
        return any(ORG_WORDS.search(LIBRARY_SENSE.sub("", w)) or ORDINALS.search(w) for _, w in _prose(path, text))

    ok = ["async with aiohttp.ClientSession() as %s:\n    await %s.get(url)\n" % (WORK_WORD, WORK_WORD),
          "@pytest.fixture(scope=\"%s\")\ndef f():\n    pass\n" % WORK_WORD,
          "subprocess.Popen(cmd, start_new_%s=True)\n" % WORK_WORD]
    bad = ["# measured in the twenty-third %s\nx = 1\n" % WORK_WORD,
           "\"\"\"(a %s of review)\"\"\"\n" % ("hel" + "per"),
           "x = 1  # the Seventeenth run\n"]
    assert not any(flagged("a.py", t) for t in ok)
    assert all(flagged("a.py", t) for t in bad)
    assert flagged("README.md", "the %s's figures\n" % WORK_WORD)
    assert NUMBERED_NAME.search("bench/results/cpu-2026-12-05-zen4-23rd/x.json")
    assert NUMBERED_NAME.search("bench/results/cpu-peer-%s5/x.json" % WORK_WORD)
    assert not NUMBERED_NAME.search("bench/results/cpu-peer-2026-12-05-zen4-0c1184f/x.json")


# ----------------------------------------------------------------------------------------- links
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|(?:src|href)=\"([^\"]+)\"")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
EXPLICIT_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped (word characters,
    spaces and hyphens kept), spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(md: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set(EXPLICIT_ID.findall(md))
    for h in HEADING.findall(FENCE.sub("", md)):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(md: str) -> list[str]:
    body = CODE.sub("", FENCE.sub("", md))
    return [a or b for a, b in LINK.findall(body)]


def broken_links(path: str, files: set[str]) -> list[str]:
    md = (ROOT / path).read_text()
    dirs = {str(Path(f).parent) for f in files} | {str(p) for f in files for p in Path(f).parents}
    bad = []
    for target in links(md):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: outside the repository
            continue
        where, _, anchor = target.partition("#")
        if where:
            resolved = (ROOT / path).parent.joinpath(where).resolve()
            try:
                rel = str(resolved.relative_to(ROOT))
            except ValueError:
                bad.append(f"{target}: outside the repository")
                continue
            if rel not in files and rel not in dirs:
                bad.append(f"{target}: no tracked file {rel}")
                continue
        else:
            rel = path
        if anchor and rel.endswith(".md") and anchor not in anchors((ROOT / rel).read_text()):
            bad.append(f"{target}: no heading #{anchor} in {rel}")
    return bad


def test_links_inside_the_repository_resolve():
    files = set(tracked())
    bad = [f"{p}: {b}" for p in sorted(files) if p.endswith(".md") and not p.startswith(VENDORED)
           for b in broken_links(p, files)]
    assert not bad, "\n".join(bad)


def test_the_link_check_catches_what_it_looks_for(tmp_path, monkeypatch):
    md = ("# A `code` heading: (with) punctuation\n\n## Twice\n\n## Twice\n\n<a id=\"here\"></a>\n"
          "[ok](#a-code-heading-with-punctuation) [ok](#twice-1) [ok](#here) ![img](pic.png) "
          "[ok](https://example.com/x) `[not a link](nowhere.md)`\n"
          "[bad](#twice-2) [bad](missing.md) [bad](../outside.md) [bad](other.md#nope)\n"
          "```\n[not a link](nowhere.md)\n```\n")
    (tmp_path / "doc.md").write_text(md)
    (tmp_path / "pic.png").write_bytes(b"\0")
    (tmp_path / "other.md").write_text("# Other\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    bad = broken_links("doc.md", {"doc.md", "pic.png", "other.md"})
    assert [b.split(":")[0] for b in bad] == ["#twice-2", "missing.md", "../outside.md", "other.md#nope"], bad
