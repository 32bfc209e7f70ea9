"""What every layer runs on: anyio task helpers, the tensor-parallel process group, the on-disk
cache and the OpenMP policy. Nothing here imports torch at package import."""
