"""
The documents of a large corpus, in order: local parquet files (a `text` column), JSON lines (a "text"
field, optionally gzipped) and .txt files (one document each), or a dataset's parquet files on the
Hugging Face hub. corpus.py turns them into token shards. (conversations.py reads a chat dataset's files, JSON
lines and parquet, with the same readers: local_files, jsonl_records, parquet_values.)

A source gives its documents after the first `skip` (documents(skip)), so an interrupted preparation
continues where it stopped; parquet row groups wholly skipped are never read.
"""

import gzip
import json
import os

from machinery.errors import UserError

PARQUET_BATCH_ROWS = 1024
PARQUET_BUFFER_BYTES = 1 << 20
PYARROW_HINT = "pip install pyarrow==26.0.1"
HUB_HINT = "pip install huggingface_hub==2.4.0"
LOCAL_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".json.gz", ".txt")


def _import_pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading parquet files needs pyarrow: {PYARROW_HINT}") from None
    return pq


def open_parquet(path, column="text", what="documents"):
    """A pyarrow ParquetFile that has the column (checked from the footer alone)."""
    pq = _import_pyarrow_parquet()
    try:
        # a buffered stream reads a row group's pages as they are needed: without it pyarrow loads the
        # whole column chunk first, and some corpora ship row groups of hundreds of MB
        pf = pq.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_BUFFER_BYTES)
    except Exception as e:  # pyarrow.ArrowInvalid and friends: not a parquet file
        raise UserError(f"{path} is not a readable parquet file ({type(e).__name__}); replace or remove it") from None
    if column not in pf.schema_arrow.names:
        raise UserError(f"{path} has no `{column}` column (columns: {', '.join(pf.schema_arrow.names)}); "
                        f"give parquet files with the {what} in a `{column}` column")
    return pf


def parquet_values(path, column, skip=0):
    """The values of a parquet file's column (as Python objects), in row order, after the first `skip` rows (whole
    row groups skipped are never read)."""
    pf = open_parquet(path, column)
    for g in range(pf.num_row_groups):
        rows = pf.metadata.row_group(g).num_rows
        if skip >= rows:
            skip -= rows
            continue
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[g], columns=[column]):
            values = batch.column(0).to_pylist()
            if skip:
                values, skip = values[skip:], max(0, skip - len(values))
            yield from values


def _parquet_docs(path, skip):
    """The `text` values of a parquet file, in row order, after the first `skip` rows."""
    for text in parquet_values(path, "text", skip):
        if not isinstance(text, str):
            raise UserError(f"{path} has a row whose `text` is {text!r}, not a string; remove that row")
        yield text


def jsonl_records(path):
    """(line number, value) of each non-blank line of a JSON lines file (optionally gzipped), with one-line errors
    for a line that is not JSON and a file that is not UTF-8."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    raise UserError(f"{path} line {number} is not valid JSON; give one JSON object per line") from None
                yield number, record
    except (UnicodeDecodeError, OSError, EOFError) as e:
        raise UserError(f"cannot read {path} as UTF-8 JSON lines ({type(e).__name__}); check the file") from None


def _jsonl_docs(path):
    for number, record in jsonl_records(path):
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise UserError(f"{path} line {number} has no string \"text\" field; "
                            f"give one {{\"text\": ...}} object per line")
        yield text


def _txt_doc(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8 first") from None


def _parquet_docs_after(path, skip):
    """The documents of a parquet file after the first `skip`, and what is left of skip for the next files.

    A file wholly skipped is not read, only its row count."""
    rows = open_parquet(path).metadata.num_rows
    if skip >= rows:
        return iter(()), skip - rows
    return _parquet_docs(path, skip), 0


def _documents_of_files(paths, skip):
    """The documents of the files in order, after the first `skip` (parquet row groups skipped unread)."""
    for path in paths:
        if path.endswith(".parquet"):
            docs, skip = _parquet_docs_after(path, skip)
            yield from docs
            continue
        docs = [_txt_doc(path)] if path.endswith(".txt") else _jsonl_docs(path)
        for doc in docs:
            if skip:
                skip -= 1
                continue
            yield doc


def local_files(path, suffixes, what="documents"):
    """--input's files: path itself, or the files under the directory path whose names end with one of suffixes
    (walked in sorted order); one-line errors for a missing path, an empty directory, a file of another kind."""
    full = os.path.abspath(path)
    if os.path.isfile(path):
        files = [full]
    elif os.path.isdir(path):
        files = [os.path.join(root, f) for root, dirs, names in sorted(os.walk(full))
                 for f in sorted(names) if f.endswith(suffixes) and not f.startswith(".")]
        if not files:
            raise UserError(f"{path} holds no {', '.join(suffixes)} files; give a directory of {what}")
    else:
        raise UserError(f"input {path} does not exist; pass an existing file or directory with --input")
    if not files[0].endswith(suffixes):
        raise UserError(f"{path} is not a {', '.join(suffixes)} file; give {what} in one of those formats")
    return files


class LocalSource:
    """The documents of a local file or directory (walked in sorted order).

    Parquet files with a `text` column, JSON lines with a "text" field (optionally gzipped), and .txt files
    (one document each)."""

    def __init__(self, path, suffixes=LOCAL_SUFFIXES):
        self.path = os.path.abspath(path)
        self.description = self.path
        self.files = local_files(path, suffixes)
        for f in self.files:  # footers only: a bad parquet file stops us before anything is written
            if f.endswith(".parquet"):
                open_parquet(f)

    def documents(self, skip=0):
        return _documents_of_files(self.files, skip)


class HubSource:
    """The documents of a dataset's parquet files on the Hugging Face hub.

    The files are downloaded one by one into the hub cache (huggingface_hub's hf_hub_download) and read
    locally. (The tests fake the hub's two calls: no network here.)"""

    def __init__(self, repo_id, subset=None):
        self.repo_id, self.subset = repo_id, subset
        self.description = f"hf://datasets/{repo_id}" + (f"/{subset}" if subset else "")
        self.revision, self.names = self.files()  # now: no network or subset error once writing has begun

    def _hub(self):
        _import_pyarrow_parquet()
        try:
            import huggingface_hub
        except ImportError:
            raise UserError(f"downloading from the Hugging Face hub needs huggingface_hub: {HUB_HINT} "
                            f"(or pass local parquet files with --input DIR)") from None
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()  # its retry warnings would turn our one-line errors into many lines
        return huggingface_hub

    def _prefix(self):
        # FineWeb(-Edu) keeps sample-10BT in sample/10BT/, the whole corpus in data/, each dump in data/<dump>/
        if self.subset is None:
            return ""
        if self.subset.startswith("sample-"):
            return "sample/" + self.subset[len("sample-"):] + "/"
        return "data/" if self.subset == "default" else f"data/{self.subset}/"

    def files(self):
        """(revision, sorted parquet paths); the hub's own parquet conversion when the main branch has none."""
        hub = self._hub()
        for revision in (None, "refs/convert/parquet"):
            try:
                names = hub.HfApi().list_repo_files(self.repo_id, repo_type="dataset", revision=revision)
            except Exception as e:
                raise UserError(f"cannot list {self.description} on the Hugging Face hub ({type(e).__name__}); "
                                f"check the network, or download the parquet files and pass --input DIR") from None
            found = sorted(n for n in names if n.endswith(".parquet") and n.startswith(self._prefix()))
            if found:
                return revision, found
        raise UserError(f"{self.description} has no parquet files; check --subset")

    def documents(self, skip=0):
        hub = self._hub()
        for name in self.names:
            try:
                path = hub.hf_hub_download(self.repo_id, name, repo_type="dataset", revision=self.revision)
            except Exception as e:
                raise UserError(f"cannot download {name} of {self.description} ({type(e).__name__}); "
                                f"run again to continue where it stopped") from None
            docs, skip = _parquet_docs_after(path, skip)
            yield from docs
