//! `memory://` backend (in progress).
