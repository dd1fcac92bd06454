"""Storage a process contributes to the pool: its segment, SSD tier and data server
(:mod:`.storage`, in a master or a node), ``kvpool node`` (:mod:`.node`), and the catalog
changes owed to nodes with their heartbeats (:mod:`.catalog`)."""
