"""The copy transport: DMA copies and stream flag operations between ranks' buffers.

- ``copy_engine``: copies and stream memory operations, per runtime (CUDA, HIP, CPU).
- ``world``: where ranks live (rank, size, device, kind, peer memory, group), and the
  world builders (process group, emulated ranks, one rank).
- ``peer_memory``: peer-visible buffers (symmetric memory, pinned host memory, files);
  ``host_peer_memory`` the gpu-host world's (shared files registered with the runtime).
- ``signals`` / ``gpu_signals``: cross-rank flags and epochs (host spin / stream waits).
- ``copy_transport``: one rank's publish / pull / fence steps over those pieces;
  ``call_streams`` and ``side_lanes`` the streams its calls run on; ``trace`` its
  step timeline; ``passive_peers`` the one-active-rank timing mode.

The algorithms (``radiance_ar.backends``) drive it; it imports no algorithm.
"""
