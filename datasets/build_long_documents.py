"""Rebuild datasets/long_documents.jsonl from Python standard-library docstrings.

Each document is the reference text of one standard-library module (the
module docstring followed by the docstrings of its public functions, classes
and methods, i.e. what `pydoc` shows, without the inherited-member noise),
cleaned into plain text and cut at a paragraph boundary so that it holds
between MIN_TOKENS and MAX_TOKENS SmolLM2 tokens.

Nothing is downloaded: the text comes from the interpreter running the
script, and the token counts from the lab's SmolLM2 tokenizer.

    .venv/bin/python datasets/build_long_documents.py            # rewrite the file
    .venv/bin/python datasets/build_long_documents.py --check    # only compare

The output is deterministic for a given Python minor version (the texts were
generated with CPython 3.11; another version produces slightly different
documents and the script says so).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
OUTPUT = HERE / "long_documents.jsonl"

#: Python version the committed file was generated with.
REFERENCE_VERSION = (3, 11)
MIN_TOKENS = 1600
MAX_TOKENS = 3000  # well under the 3,500 ceiling, leaves room for a question

#: (id, module) in output order. Every module yields far more than
#: MAX_TOKENS of text, so each document is cut to roughly the same length.
MODULES = [
    ("doc01", "argparse"),
    ("doc02", "collections"),
    ("doc03", "decimal"),
    ("doc04", "json"),
    ("doc05", "logging"),
    ("doc06", "pathlib"),
    ("doc07", "re"),
    ("doc08", "statistics"),
    ("doc09", "unittest"),
    ("doc10", "zipfile"),
    ("doc11", "itertools"),
    ("doc12", "difflib"),
    ("doc13", "threading"),
    ("doc14", "urllib.parse"),
    ("doc15", "subprocess"),
    ("doc16", "random"),
]

GENERIC_DOCS = (
    "Initialize self.  See help(type(self)) for accurate signature.",
    "Create and return a new object.  See help(type) for accurate signature.",
    "Call self as a function.",
)


def default_tokenizer_dir() -> Path:
    """The lab's embedded SmolLM2 folder (same rules as lab_utils.model)."""
    override = os.environ.get("LAB_MODEL_DIR")
    if override:
        return Path(override)
    cache = os.environ.get("LAB_CACHE_DIR")
    base = Path(cache) if cache else Path.home() / ".cache" / "vllm-latency-lab"
    return base.expanduser() / "models" / "SmolLM2-135M-Instruct"


# --------------------------------------------------------------------------
# Text extraction and cleaning
# --------------------------------------------------------------------------

_OVERSTRIKE = re.compile(r".\x08")
_RST_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|data|exc|const|obj|term|ref|pep|rfc):`~?([^`]+)`")


def clean(text: str) -> str:
    """Plain, readable text: no overstrike, no RST roles, no whitespace runs."""
    text = _OVERSTRIKE.sub("", text)
    text = _RST_ROLE.sub(r"\1", text)
    text = text.replace("\t", "    ").replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)  # at most one blank line
    return text.strip()


def docstring(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    doc = doc.strip()
    if not doc or doc in GENERIC_DOCS:
        return ""
    return doc


_FUNC_REPR = re.compile(r"<(?:built-in )?function ([\w.]+) at 0x[0-9a-fA-F]+>")
_ADDR_REPR = re.compile(r"<([^<>]*?) at 0x[0-9a-fA-F]+>")


def signature(name: str, obj) -> str:
    """`name(params)`, with memory addresses removed so the text is stable."""
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return name
    sig = _FUNC_REPR.sub(r"\1", sig)
    sig = _ADDR_REPR.sub(r"<\1>", sig)
    return f"{name}{sig}"


def public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = sorted(
            n for n, v in vars(module).items()
            if not n.startswith("_")
            and (inspect.isclass(v) or inspect.isroutine(v))
            and getattr(v, "__module__", None) == module.__name__)
    return list(names)


def class_section(qualname: str, cls) -> list[str]:
    paragraphs = []
    doc = docstring(cls)
    head = f"class {signature(qualname, cls)}"
    paragraphs.append(head + (":\n" + doc if doc else ""))
    for name, member in cls.__dict__.items():
        if name.startswith("_") and name not in ("__init__", "__call__"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property) or inspect.isdatadescriptor(member):
            doc = docstring(member)
            if doc:
                paragraphs.append(f"{qualname}.{name} (attribute):\n{doc}")
            continue
        if not inspect.isroutine(member):
            continue
        doc = docstring(member)
        if not doc:
            continue
        paragraphs.append(f"{signature(qualname + '.' + name, member)}:\n{doc}")
    return paragraphs


def module_text(modname: str) -> str:
    module = importlib.import_module(modname)
    parts = [f"{modname} - Python standard library module reference"]
    doc = docstring(module)
    if doc:
        parts.append(doc)
    seen: set[int] = set()
    for name in public_names(module):
        obj = getattr(module, name, None)
        if obj is None or id(obj) in seen or inspect.ismodule(obj):
            continue
        seen.add(id(obj))
        if inspect.isclass(obj):
            parts.extend(class_section(f"{modname}.{name}", obj))
        elif inspect.isroutine(obj):
            doc = docstring(obj)
            if doc:
                parts.append(f"{signature(modname + '.' + name, obj)}:\n{doc}")
    return clean("\n\n".join(parts))


# --------------------------------------------------------------------------
# Cutting at a paragraph boundary
# --------------------------------------------------------------------------

def cut(text: str, count, limit: int) -> str:
    """Longest run of leading paragraphs whose token count is <= limit."""
    paragraphs = text.split("\n\n")
    kept: list[str] = []
    approx = 0
    for para in paragraphs:
        n = count(para) + 1
        if approx + n > limit:
            break
        kept.append(para)
        approx += n
    while kept and count("\n\n".join(kept)) > limit:
        kept.pop()
    # Do not end on a line that only announces what follows.
    while len(kept) > 1 and kept[-1].rstrip().endswith((":", "::")) and "\n" not in kept[-1]:
        kept.pop()
    return "\n\n".join(kept)


def build(tokenizer_dir: Path) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def count(s: str) -> int:
        return len(tok(s, add_special_tokens=False).input_ids)

    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    records = []
    for doc_id, modname in MODULES:
        text = cut(module_text(modname), count, MAX_TOKENS)
        n = count(text)
        if not MIN_TOKENS <= n <= MAX_TOKENS:
            raise SystemExit(f"{doc_id} ({modname}): {n} tokens, outside "
                             f"{MIN_TOKENS}-{MAX_TOKENS}")
        records.append({
            "id": doc_id,
            "title": f"The {modname} module (Python standard library reference)",
            "source": (f"CPython {version} standard library documentation "
                       f"(docstrings of module {modname}, as shown by pydoc)"),
            "licence": "PSF-2.0",
            "tokens": n,
            "text": text,
        })
    return records


def serialise(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=default_tokenizer_dir(),
                        help="SmolLM2 tokenizer folder (default: the lab model)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the file would change")
    args = parser.parse_args(argv)

    if sys.version_info[:2] != REFERENCE_VERSION:
        print(f"warning: running on Python {sys.version_info.major}."
              f"{sys.version_info.minor}; the committed file was built with "
              f"{REFERENCE_VERSION[0]}.{REFERENCE_VERSION[1]}, texts will differ.",
              file=sys.stderr)

    records = build(args.tokenizer)
    data = serialise(records)
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != data:
            print(f"{args.output} is out of date", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date ({len(records)} documents)")
        return 0
    args.output.write_text(data, encoding="utf-8")
    for r in records:
        print(f"{r['id']}  {r['tokens']:5d} tokens  {r['title']}")
    print(f"wrote {len(records)} documents to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
