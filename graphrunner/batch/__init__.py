"""The decode batch (:mod:`.decode_batch`), its argument checks (:mod:`.checks`),
host-side helpers (:mod:`.host`) and KV slot choice (:mod:`.paging`)."""
