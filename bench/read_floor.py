#!/usr/bin/env python3
"""Reads every file under PATH once, as fast as the disk allows, and discards it.

The floor for any tool that has to read its input: THREADS threads take 16 MiB
pieces of the files in order and read each with one positioned read, bypassing the
page cache (O_DIRECT) where the filesystem allows, so that many requests are in
flight at once, as a merge keeps them. `cat` reads one 128 KiB request at a time
and on a disk with high latency measures that latency, not the disk's bandwidth.
With --buffered the reads go through the page cache (for inputs already cached).

  python3 bench/read_floor.py [--buffered] PATH [THREADS]
"""

import mmap
import os
import sys
import threading

PIECE = 16 << 20


def files(path):
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def main():
    args = sys.argv[1:]
    direct = "--buffered" not in args
    args = [a for a in args if a != "--buffered"]
    path = args[0]
    threads = int(args[1]) if len(args) > 1 else 4
    work = []
    fds = []
    for p in files(path):
        try:
            fd = os.open(p, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
        except OSError:
            fd = os.open(p, os.O_RDONLY)
        fds.append(fd)
        size = os.fstat(fd).st_size
        work.extend((fd, off) for off in range(0, size, PIECE))
    work.reverse()
    lock = threading.Lock()

    def reader():
        buf = mmap.mmap(-1, PIECE)  # page-aligned, as direct reads need
        while True:
            with lock:
                if not work:
                    return
                fd, off = work.pop()
            try:
                os.preadv(fd, [buf], off)
            except OSError:
                # A filesystem that takes O_DIRECT opens but not these reads.
                os.pread(fd, PIECE, off)

    ts = [threading.Thread(target=reader) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for fd in fds:
        os.close(fd)


if __name__ == "__main__":
    main()
