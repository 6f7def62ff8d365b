"""The front-end's parts, composed by ``shmserve.server``.

=====================  =====================================================
module                 owns
=====================  =====================================================
``requests``           a request's life in the front-end: one transition table
``dispatcher``         every request from admission to release (arena space,
                       slot, publication, worker choice, completion, timeout,
                       error); knows no socket: front doors hand it requests
``models``             the models served, their versions and defaults, which
                       workers of a version are ready, and which version a
                       request (model, version, routing key) goes to
``lifecycle``          each version's phase and what moves it: load beside,
                       swap the default in one step, drain, unload, scale,
                       reload, load on demand, evict; canary start and end
``canary``             a canary rollout's decisions (plan, split, sticky
                       keys, thresholds, shadow comparison), pure logic
``residency``          which versions to evict under a memory budget, and
                       the decayed request rate that orders them, pure logic
``regions``            client regions and lanes: create, attach to workers,
                       move when a worker dies, remove
``status``             the read-only snapshot that ``info``, health,
                       ``repository`` and metrics read
``unix``               the Unix-socket front door (native protocol)
=====================  =====================================================

Must not: import CUDA or a model runtime, or block the event loop.
"""
