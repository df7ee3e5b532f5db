"""The plugin manager in a forked child: a lock a parent thread held at the fork is not
inherited held (a connect loading a plugin on another thread must not wedge the child)."""

from __future__ import annotations

import os
import threading

import pytest

from kvfabric import _plugins


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_holds_the_plugin_locks_selects_plugins() -> None:
    manager = _plugins.plugin_manager()
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with _plugins._default_lock, manager._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:  # the child: select a plugin, exit 0 on success
            code = 1
            try:
                if _plugins.plugin_manager().transport("tcp").name == "tcp":
                    code = 0
            finally:
                os._exit(code)
        # A wedged child would never exit: bound the wait, then kill it.
        for _ in range(3000):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            threading.Event().wait(0.01)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child hung selecting a plugin")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        holder.join()
