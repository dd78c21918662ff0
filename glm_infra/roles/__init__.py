"""Roles: what one concern puts on a host, as steps of the per-host plan (apply | check | remove) and the
files they render. hostplan orders the roles' steps per host."""
