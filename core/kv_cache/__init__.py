"""The paged KV cache's bookkeeping: blocks, block tables, ref counts, prefix caching."""
