"""Parquet and Arrow inputs for tools/preprocess_data.py (what Hugging Face `datasets` exports), read with pyarrow.

A .parquet file is streamed by record batches of its row groups (ParquetFile.iter_batches); an .arrow file is
Arrow's IPC format, either the random-access file format (pyarrow.ipc.open_file) or the stream format that
`datasets` writes (Dataset.save_to_disk, its cache files; pyarrow.ipc.open_stream), read from a memory map.
Only the --json-keys columns are read. Each batch becomes a corpus.Chunk whose `columns` hold the values by key,
and whose line numbers are row numbers (from 1), so problems name the file and the row.
"""
import os

COLUMNAR_SUFFIXES = (".parquet", ".arrow")
TEXT_KEY_NAMES = ("text", "content", "document", "raw_content", "body", "article", "sentence")


def is_columnar(path):
    return path.endswith(COLUMNAR_SUFFIXES)


def _open_arrow(path):
    """(schema, iterator of record batches, row count or None) of an Arrow IPC file or stream."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    source = pa.memory_map(path, "r")
    try:
        reader = ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches)), None
    except pa.ArrowInvalid:
        source.seek(0)
    reader = ipc.open_stream(source)
    return reader.schema, iter(reader), None


def read_schema(path):
    """{column name: Arrow type} from the file's metadata (no rows are read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path) if path.endswith(".parquet") else _open_arrow(path)[0]
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"--input {path}: cannot be read as {'Parquet' if path.endswith('.parquet') else 'Arrow'} "
                         f"({exc}); pass a .parquet or .arrow file that pyarrow opens") from None
    return {field.name: field.type for field in schema}


def _is_text(arrow_type):
    import pyarrow as pa
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def guess_text_key(candidates):
    """The key to suggest for --json-keys: a usual name for a text column if one is there, else the first."""
    for name in TEXT_KEY_NAMES:
        if name in candidates:
            return name
    return candidates[0] if candidates else None


def check_columns(path, json_keys):
    """ValueError naming the missing (or non-text) column and the one to pass instead, before anything is read
    or written."""
    columns = read_schema(path)
    fix = guess_text_key([name for name, kind in columns.items() if _is_text(kind) and name not in json_keys])
    fix = f"pass --json-keys {fix}" if fix else "it has no other text column to tokenize"
    for key in json_keys:
        if key not in columns:
            raise ValueError(f"--input {path} has no column {key!r}; its columns are {', '.join(columns)}: {fix}")
        if not _is_text(columns[key]):
            raise ValueError(f"--input {path}: column {key!r} holds {columns[key]}, not text; its columns are "
                             f"{', '.join(columns)}: {fix}")


def read_columnar_chunks(path, json_keys, chunk_rows, chunk_type):
    """Yields chunk_type(path, first_row, [], input_bytes, columns={key: [value, ...]}) of at most chunk_rows rows."""
    import pyarrow.parquet as pq

    size = os.path.getsize(path)
    if path.endswith(".parquet"):
        parquet = pq.ParquetFile(path, memory_map=True)
        total = parquet.metadata.num_rows
        batches = parquet.iter_batches(batch_size=chunk_rows, columns=list(json_keys))
    else:
        _, batches, total = _open_arrow(path)
    row, consumed = 0, 0
    for batch in batches:
        for start in range(0, batch.num_rows, chunk_rows):
            part = batch.slice(start, chunk_rows)
            columns = {key: part.column(key).to_pylist() for key in json_keys}
            row_end = row + part.num_rows
            position = size * row_end // total if total else min(size, consumed + part.nbytes)
            yield chunk_type(path, row + 1, [], max(0, position - consumed), columns=columns)
            row, consumed = row_end, max(consumed, position)
    if consumed < size:  # the rest of the file (footer, schema) counts as read
        yield chunk_type(path, row + 1, [], size - consumed, columns={key: [] for key in json_keys})
