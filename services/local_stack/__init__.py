"""`python -m services.local_stack`: the whole fabric on loopback — redis, router, workers, gateway,
job runner.

Each tier runs as its own child process, as in production. The launcher owns them: it starts them
in dependency order (redis → router → workers → gateway → job runner), waits until each is
ready, and stops them front to back (job runner and gateway first, so no new request enters
while the tiers behind it drain).

Redis runs with the fabric's ACL (services.common.redis_acl) and new random passwords on every
start, kept in `<state-dir>/redis-acl/`: the router and the workers get their role's password
file (`--redis-password-file`, never the password itself on a command line); `admin-password`
there is for you (`redis-cli --user admin --pass "$(cat .../admin-password)"`).
"""
