// Preloaded with `node -r` by up.sh: kinesis-local listens on 0.0.0.0 and has
// no setting for the address, so every server it opens is bound to
// ONCEFLOW_BIND_HOST (default 127.0.0.1) instead.
'use strict';
const net = require('net');

const host = process.env.ONCEFLOW_BIND_HOST || '127.0.0.1';
const listen = net.Server.prototype.listen;

net.Server.prototype.listen = function (...args) {
  const first = args[0];
  if (first !== null && typeof first === 'object' && !Array.isArray(first)) {
    // listen({ port, host, ... }, cb)
    if (first.path === undefined) args[0] = Object.assign({}, first, { host });
  } else if (typeof first === 'number' || (typeof first === 'string' && /^\d+$/.test(first))) {
    // listen(port[, host][, backlog][, cb])
    if (typeof args[1] === 'string') args[1] = host;
    else args.splice(1, 0, host);
  }
  return listen.apply(this, args);
};
