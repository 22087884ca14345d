"""A context manager that counts XLA backend compilations (jax.monitoring's compile-duration event)."""

import jax


class BackendCompiles:
    """Counts XLA backend compilations while active: `with BackendCompiles() as c: ...; c.count`."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        self.count = 0

        def listener(event, duration, **kwargs):
            if event == self.EVENT:
                self.count += 1

        self._listener = listener
        jax.monitoring.register_event_duration_secs_listener(listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)
