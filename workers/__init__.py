"""shmserve workers: processes bound to one device that run requests from the arena in place."""
