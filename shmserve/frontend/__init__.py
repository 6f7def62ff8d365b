"""The front-end's parts, composed by ``shmserve.server``.

=====================  =====================================================
module                 owns
=====================  =====================================================
``requests``           a request's life in the front-end: one transition table
``dispatcher``         every request from admission to release (arena space,
                       slot, publication, worker choice, completion, timeout,
                       error); knows no socket: front doors hand it requests
``models``             the models served and which of their workers is ready
``regions``            client regions and lanes: create, attach to workers,
                       move when a worker dies, remove
``status``             the read-only snapshot that ``info``, health and
                       metrics read
``unix``               the Unix-socket front door (native protocol)
=====================  =====================================================

Must not: import CUDA or a model runtime, or block the event loop.
"""
