"""Corpora and tasks shipped inside the package, in ``mechgeom/data/files/``.

The files travel in the wheel and are read with :mod:`importlib.resources`, so an installed mechgeom needs no
source checkout. ``files/SOURCES.md`` gives the provenance of each file and ``files/LICENSES.md`` its licence.

- :func:`load_corpus` cuts fixed-length token windows from WikiText-2 (test), GSM8K (test) or a C4 sample.
- :func:`load_task` returns multiple-choice items (BoolQ dev sample, Winogrande dev, 16 MMLU subjects)
  with their choices and gold answer.

>>> items = load_task("winogrande", n=2, seed=0)
>>> len(items), len(items[0].choices)
(2, 2)
>>> (data_dir() / "SOURCES.md").is_file()
True
"""

from __future__ import annotations

import csv
import io
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from mechgeom.typing import Tokens

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = ["CORPORA", "TASKS", "TaskItem", "corpus_texts", "data_dir", "load_corpus", "load_task"]

CORPORA = ("wikitext2", "gsm8k", "c4")
TASKS = ("boolq", "winogrande", "mmlu")
Corpus = Literal["wikitext2", "gsm8k", "c4"]
Task = Literal["boolq", "winogrande", "mmlu"]


def _files() -> Traversable:
    """The packaged data folder as an :mod:`importlib.resources` Traversable (also inside a zip)."""
    return resources.files(__name__) / "files"


def data_dir() -> Path:
    """The packaged data folder, ``mechgeom/data/files/`` inside the installed package, as a ``Path``.

    It holds the corpora, the tasks, ``SOURCES.md`` and ``LICENSES.md``. Raises ``FileNotFoundError``
    when the folder is missing, or when mechgeom is imported from a zip archive (then the files have no
    path of their own; the loaders still read them through :mod:`importlib.resources`).
    """
    root = _files()
    if not isinstance(root, Path):
        raise FileNotFoundError(
            f"mechgeom's data files are inside an archive ({root}), so they have no path of their own; "
            "read them with importlib.resources.files('mechgeom.data') / 'files'"
        )
    if not root.is_dir():
        raise FileNotFoundError(
            f"mechgeom's data folder is missing at {root}; reinstall mechgeom (its wheel carries the data)"
        )
    return root


def _read_jsonl(path: Traversable) -> list[dict[str, Any]]:
    with path.open("r", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def corpus_texts(corpus: str) -> list[str]:
    """The documents of a corpus, in file order.

    WikiText-2 is split into articles at its `` = Title = `` headings; GSM8K documents are
    ``question + answer``; C4 documents are the sample's ``text`` fields.
    """
    root = _files()
    if corpus == "wikitext2":
        text = (root / "wikitext2_raw_test.txt").read_text(encoding="utf-8")
        docs: list[list[str]] = []
        for line in text.split("\n"):
            s = line.strip()
            if s.startswith("= ") and s.endswith(" =") and not s.startswith("= ="):
                docs.append([])
            if not docs:
                docs.append([])
            docs[-1].append(line)
        return ["\n".join(d).strip() for d in docs if "".join(d).strip()]
    if corpus == "gsm8k":
        return [
            f"Question: {r['question']}\nAnswer: {r['answer']}"
            for r in _read_jsonl(root / "gsm8k_test.jsonl")
        ]
    if corpus == "c4":
        return [r["text"] for r in _read_jsonl(root / "c4_en_sample450.jsonl")]
    raise ValueError(f"unknown corpus {corpus!r}; choose from {list(CORPORA)}")


def load_corpus(
    corpus: str,
    tokenizer: Any,
    *,
    n_texts: int = 8,
    seq_len: int = 256,
    seed: int = 0,
    n_ctx: int | None = None,
    prepend_bos: bool | None = None,
) -> Tokens:
    """``n_texts`` token windows of exactly ``seq_len`` tokens, ``[n_texts, seq_len]``.

    ``tokenizer`` is a HuggingFace tokenizer or a model with ``.tokenizer`` (then ``n_ctx`` and the BOS
    default are read from the model). Documents are shuffled with ``seed``; each contributes its first
    window. GSM8K problems are short, so for GSM8K consecutive problems are concatenated (separated by
    a blank line) before cutting windows. With ``prepend_bos`` the first token of each window is BOS. For an
    encoder (a model whose attention is bidirectional) each window is ``[CLS] text [SEP]``.

    Raises ``ValueError`` for an unknown corpus, ``seq_len`` above ``n_ctx`` or non-positive sizes, and
    when the corpus cannot supply ``n_texts`` windows.
    """
    model = None
    encoder = False
    if hasattr(tokenizer, "tokenizer") and hasattr(tokenizer, "cfg"):
        model, tokenizer = tokenizer, tokenizer.tokenizer
        n_ctx = int(model.cfg.n_ctx) if n_ctx is None else n_ctx
        encoder = getattr(model.cfg, "attention_dir", "causal") == "bidirectional"
        if prepend_bos is None:
            prepend_bos = False if encoder else bool(getattr(model.cfg, "default_prepend_bos", False))
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose from {list(CORPORA)}")
    if n_texts <= 0 or seq_len <= 0:
        raise ValueError(f"n_texts and seq_len must be positive, got {n_texts} and {seq_len}")
    if n_ctx is not None and seq_len > n_ctx:
        raise ValueError(f"seq_len={seq_len} is longer than the model's n_ctx={n_ctx}")
    bos = [tokenizer.bos_token_id] if prepend_bos and tokenizer.bos_token_id is not None else []
    eos: list[int] = []
    if encoder:  # an encoder's text is [CLS] body [SEP], as its tokenizer writes it
        bos, eos = [int(tokenizer.cls_token_id)], [int(tokenizer.sep_token_id)]
    body = seq_len - len(bos) - len(eos)
    if body <= 0:
        raise ValueError(f"seq_len={seq_len} leaves no room for text beside the special tokens")
    docs = corpus_texts(corpus)
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    windows: list[list[int]] = []
    if corpus == "gsm8k":
        stream: list[int] = []
        for idx in order:
            stream += tokenizer(docs[idx] + "\n\n", add_special_tokens=False)["input_ids"]
            while len(stream) >= body and len(windows) < n_texts:
                windows.append(bos + stream[:body] + eos)
                stream = []
            if len(windows) == n_texts:
                break
    else:
        for idx in order:
            ids = tokenizer(docs[idx], add_special_tokens=False)["input_ids"]
            if len(ids) >= body:
                windows.append(bos + ids[:body] + eos)
            if len(windows) == n_texts:
                break
    if len(windows) < n_texts:
        raise ValueError(f"{corpus} has only {len(windows)} windows of {seq_len} tokens; asked for {n_texts}")
    return torch.tensor(windows, dtype=torch.long)


@dataclass(frozen=True)
class TaskItem:
    """One multiple-choice item: the model scores ``prompt + choice`` for each choice."""

    task: str
    prompt: str
    choices: tuple[str, ...]
    answer: int
    meta: str = ""


def _mmlu_items() -> list[TaskItem]:
    items: list[TaskItem] = []
    paths = [p for p in (_files() / "mmlu" / "test").iterdir() if p.name.endswith("_test.csv")]
    for path in sorted(paths, key=lambda p: p.name):
        subject = path.name.removesuffix("_test.csv")
        # bytes, then no newline translation: the same rows as open(newline="") (fields may hold newlines)
        with io.StringIO(path.read_bytes().decode("utf-8"), newline="") as f:
            for row in csv.reader(f):
                q, a, b, c, d, gold = row
                prompt = (
                    f"The following is a multiple choice question about {subject.replace('_', ' ')}.\n\n"
                    f"{q}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer:"
                )
                items.append(
                    TaskItem("mmlu", prompt, (" A", " B", " C", " D"), "ABCD".index(gold.strip()), subject)
                )
    return items


def load_task(task: str, *, n: int | None = 100, seed: int = 0) -> list[TaskItem]:
    """``n`` items of a task (all of them with ``n=None``), sampled with ``seed``.

    - ``boolq``: passage + question, choices ``" no"``/``" yes"``.
    - ``winogrande``: the sentence's blank filled by each option (partial scoring: the prompt is the
      text before the blank, each choice is ``option + rest``).
    - ``mmlu``: zero-shot, choices ``" A"``..``" D"``.
    """
    root = _files()
    items: list[TaskItem]
    if task == "boolq":
        items = [
            TaskItem(
                "boolq",
                f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:",
                (" no", " yes"),
                int(r["label"]),
            )
            for r in _read_jsonl(root / "boolq_dev_sample1000.jsonl")
        ]
    elif task == "winogrande":
        items = []
        for r in _read_jsonl(root / "winogrande_dev.jsonl"):
            before, _, after = r["sentence"].partition("_")
            items.append(
                TaskItem(
                    "winogrande",
                    before.rstrip(),
                    (f" {r['option1']}{after}", f" {r['option2']}{after}"),
                    int(r["answer"]) - 1,
                )
            )
    elif task == "mmlu":
        items = _mmlu_items()
    else:
        raise ValueError(f"unknown task {task!r}; choose from {list(TASKS)}")
    if n is None or n >= len(items):
        return items
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    idx = sorted(random.Random(seed).sample(range(len(items)), n))
    return [items[i] for i in idx]
