"""vLLM's own KV event publisher in a process of its own, driven line by line on stdin.

    python -m tests.proxy.vllm_publisher PUB_ENDPOINT REPLAY_ENDPOINT

Each line ``store HASH PARENT|- T1 T2 ...`` publishes one batch with one ``BlockStored``
(block size 4, medium GPU); ``clear`` an ``AllBlocksCleared``; ``quit`` ends.  Prints
``READY`` once its sockets are bound and ``SENT n`` after each batch is queued.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    publisher = ZmqEventPublisher(0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2])
    print("READY", flush=True)
    for sent, line in enumerate(sys.stdin, start=1):
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "clear":
            event = AllBlocksCleared()
        else:
            _, block, parent, *tokens = words
            event = BlockStored(
                block_hashes=[block.encode()],
                parent_block_hash=None if parent == "-" else parent.encode(),
                token_ids=[int(t) for t in tokens],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
        time.sleep(0.05)  # the publisher's thread sends it
        print(f"SENT {sent}", flush=True)
    publisher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
