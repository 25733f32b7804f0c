"""Megatron's --split and --data-path conventions: split strings over documents and weighted dataset lists."""
import math


def parse_split_string(splits_string):
    """'969,30,1', '0.9/0.05/0.05' or '1' -> three fractions summing to 1 (missing parts are 0)."""
    text = str(splits_string).strip()
    parts = text.split(",") if "," in text else text.split("/")
    try:
        splits = [float(part) for part in parts if part.strip() != ""]
    except ValueError as exc:
        raise ValueError(f"--split {splits_string!r} is not a list of numbers; use e.g. 969,30,1") from exc
    if not splits or len(splits) > 3 or any(s < 0 or not math.isfinite(s) for s in splits):
        raise ValueError(f"--split {splits_string!r} needs one to three non-negative numbers "
                         "(train,valid,test), e.g. 969,30,1")
    splits += [0.0] * (3 - len(splits))
    total = sum(splits)
    if total <= 0:
        raise ValueError(f"--split {splits_string!r} sums to 0; give the train part a positive weight")
    return [s / total for s in splits]


def get_train_valid_test_split_(splits_string, size):
    """Document boundaries [0, end_train, end_valid, size] of Megatron's split of `size` documents.

    Each part gets round(fraction * size) documents; rounding excess is taken back from the boundaries.
    """
    splits = parse_split_string(splits_string)
    splits_index = [0]
    for index, split in enumerate(splits):
        splits_index.append(splits_index[index] + int(round(split * float(size))))
    diff = splits_index[-1] - size
    for index in range(1, len(splits_index)):
        splits_index[index] -= diff
    assert len(splits_index) == 4 and splits_index[-1] == size, (splits_index, size)
    return [max(0, s) for s in splits_index]


def parse_data_prefix(data_prefix):
    """--data-path as a list: [path] or [w1, path1, w2, path2, ...] -> (paths, weights normalised to 1)."""
    if isinstance(data_prefix, str):
        data_prefix = [data_prefix]
    data_prefix = [str(item) for item in data_prefix]
    if len(data_prefix) == 1:
        return data_prefix, [1.0]
    if len(data_prefix) % 2 != 0:
        raise ValueError(f"--data-path {' '.join(data_prefix)}: expected one path or weight/path pairs "
                         "(e.g. --data-path 0.3 c4_en_text_document 0.7 wiki_text_document)")
    weights, paths = [], []
    for weight, path in zip(data_prefix[0::2], data_prefix[1::2]):
        try:
            value = float(weight)
        except ValueError as exc:
            raise ValueError(f"--data-path: weight {weight!r} before {path} is not a number; give "
                             "weight/path pairs") from exc
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"--data-path: weight {weight} of {path} must be a finite number >= 0")
        weights.append(value)
        paths.append(path)
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--data-path: the weights {weights} sum to 0; give at least one dataset a positive weight")
    return paths, [w / total for w in weights]


def get_datasets_weights_and_num_samples(data_prefix, train_valid_test_num_samples):
    """Paths, normalised weights and, per path, the samples each split needs (weight * total, 0.5% margin)."""
    paths, weights = parse_data_prefix(data_prefix)
    per_dataset = [
        tuple(int(math.ceil(n * w * 1.005)) if n > 0 and w > 0 else 0 for n in train_valid_test_num_samples)
        for w in weights
    ]
    return paths, weights, per_dataset

