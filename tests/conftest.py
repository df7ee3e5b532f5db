"""Shared fixtures for kvfabric's own tests."""

from __future__ import annotations
