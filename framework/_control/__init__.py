"""Control-plane internals: the controller, its client, the index served remotely, secrets."""
