"""The names of a model folder's weight files (standard library only)."""

# The weight files mergekit's ShardedTensorIndex.from_disk looks for in a model
# folder: one file, or an index naming shards. (mergekit's own list lives in a
# script module, mergekit.scripts.multimerge, whose import loads mergekit.merge:
# it would re-enter the autoload install while this package is half-imported.)
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = tuple(f"{name}.index.json" for name in SINGLE_FILES)
WEIGHT_FILES = tuple(n for pair in zip(SINGLE_FILES, INDEX_FILES) for n in pair)
