#!lua name=kvfabric1
--[[
kvfabric's index inside Redis (library kvfabric1; every function is named kvf1_*).

Two kinds of state, each in ONE hash slot so that a function can change it atomically, also
in Redis Cluster:

* the registry of a namespace (hash tag {NS}): node ids by name, nodes, incarnations, the
  arenas carved from every node's regions, liveness keys with a TTL;
* an arena: a contiguous part of one region and everything about the records placed in it
  (hash tag chosen per arena). KEYS[1] is the arena's meta hash "<P>m"; the other keys share
  the prefix P, so they live in the same slot:
    <P>m         meta: node, region, base, size, rkey, id, lo, restoring, the birth of the
                 registry that listed it, gauges, counters
    <P>e:<key>   one entry per key (a packed string; a grant being written has a PX lease)
    <P>fo <P>fe  free extents by offset -> size and by end -> offset
    <P>fs        free extents sorted by size (best fit)
    <P>o  <P>oe  occupied slots by offset -> (size, kind, state, retention, key, ...) and
                 by end -> offset (eviction prices an entry from here and from OBJECT
                 IDLETIME alone: reading the entry would reset the idle clock it asks about)
    <P>r  <P>re  retired slots (waiting out the grace period) by offset and by end
    <P>rq        retired slots by the time they may be reused
    <P>p         grants by lease deadline
    <P>x         keys of entries whose record lives in another arena (restored records)
    <P>cz        offsets of records claimed while the node reports them (restore)
    <P>c         while what an older registry's arena left is cleared: the newer birth
    <P>v         KV events, while a relay asks for them (docs/kv-events.md): a stream, one
                 entry per function call that stored or removed readable keys, capped at
                 about EVENT_ENTRIES entries; each entry is ('n', its number in the arena),
                 then ('s', key .. the writer's encoded block or nothing) per key stored
                 and ('r', key) per key removed, in the order they happened. The meta
                 fields 'ev' (until when, in server milliseconds, a relay wants them) and
                 'evn' (entries written) say whether and where: with 'ev' unset or past, a
                 function writes no stream and does no more than before (the field comes
                 with the meta read every function makes anyway)

An entry starts with its descriptor in kvfabric's wire form ('<c32I4I4I8I8c8c8I4': key,
node, region, offset, length, rkey, version, crc), so a lookup returns it as it is, then
'<BI4': state (1 granted, 2 published, 3 published here but stored in another arena) and
retention; state 3 adds '<I8': the arena that holds the record. With replicas, the
descriptors of the value's other copies follow (its *alternates*, 76 bytes each): each
copy is an entry of its own in the arena that holds it, and the key's home arena lists
them so that a lookup, which reads only the home, returns them all.

Versions are 8 opaque bytes here: a new grant's version is (counter << 12) | lo, with the
arena's counter at least the server clock in microseconds, so versions grow over time and
across restarts; Lua numbers are doubles, so the 64-bit value is assembled from two exact
32-bit halves rather than computed.

Recency comes from Redis itself: lookups read entries (which moves Redis's LRU clock of the
key, while the function stays read-only), eviction asks OBJECT IDLETIME of a sample, as
Redis's own maxmemory eviction does.
]]

local GRANTED, EXISTS, IN_FLIGHT, NO_SPACE = 1, 2, 3, 4
local PENDING, PUBLISHED, FOREIGN = 1, 2, 3
local OCC_ENTRY, OCC_HOSTED = 0, 1
local SAMPLE = 16       -- occupants sampled per eviction decision
local SEEDS = 8         -- windows priced per put that does not fit (from the sample, and retired)
local BATCH = 4000      -- keys per MGET inside one function (unpack is bounded by Lua's stack)
local DROP_BATCH = 500  -- entries one call of kvf1_drop deletes (it blocks the server)
local EVENT_ENTRIES = 10000  -- entries an arena's event stream keeps (about: MAXLEN ~)
local EVENT_PAIRS = 1000     -- changes one stream entry holds at most (unpack's stack)

local function fmt(n)
  return string.format('%d', n)
end

local function clock()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + us / 1000, s * 1000000 + us
end

local COUNTERS = {
  'grants', 'dedup_hits', 'in_flight', 'no_space', 'oversize', 'published', 'publish_rejected',
  'aborted', 'unpublished', 'evictions', 'early_reuse', 'lease_expiries', 'invalid_reports',
  'restored', 'restore_duplicates', 'restore_overlaps', 'hosted_drops', 'replicas_dropped',
}
local GAUGES = {'free', 'retired', 'n_pub', 'n_pend', 'payload', 'vc'}

-- -- arena state --------------------------------------------------------------------------

local function open(keys, lease_ms, grace_ms, headroom)
  local m = keys[1]
  local meta = redis.call('HMGET', m, 'node', 'region', 'base', 'size', 'rkey8', 'id', 'lo',
    'restoring', 'free', 'retired', 'n_pub', 'n_pend', 'payload', 'vc', 'ev', 'evn')
  if not meta[1] then
    return nil
  end
  local p = string.sub(m, 1, -2)
  local a = {
    m = m, e = p .. 'e:', fo = p .. 'fo', fe = p .. 'fe', fs = p .. 'fs', o = p .. 'o',
    oe = p .. 'oe', r = p .. 'r', re = p .. 're', rq = p .. 'rq', pq = p .. 'p', x = p .. 'x',
    cz = p .. 'cz',
    node = tonumber(meta[1]), region = tonumber(meta[2]), base = tonumber(meta[3]),
    size = tonumber(meta[4]), rkey8 = meta[5], id = tonumber(meta[6]), lo = tonumber(meta[7]),
    restoring = meta[8] == '1',
    free = tonumber(meta[9]), retired = tonumber(meta[10]), n_pub = tonumber(meta[11]),
    n_pend = tonumber(meta[12]), payload = tonumber(meta[13]), vc = tonumber(meta[14]),
    lease_ms = tonumber(lease_ms or '0'), grace = tonumber(grace_ms or '0'),
    headroom = tonumber(headroom or '0'),
    ev = tonumber(meta[15] or '0'), evn = tonumber(meta[16] or '0'), changes = nil,
    d = {},
  }
  for _, name in ipairs(COUNTERS) do a.d[name] = 0 end
  return a
end

local function bump(a, name, n)
  a.d[name] = a.d[name] + (n or 1)
end

-- KV events: a change of what is readable, kept for the stream while a relay wants them.
-- Whether it does is decided at the first change of a call (the clock is read only where a
-- relay ever asked).
local function tell(a, kind, value)
  if a.changes == nil then
    if a.ev == 0 or a.ev <= clock() then
      a.changes = false
    else
      a.changes = {}
    end
  end
  if a.changes then
    a.changes[#a.changes + 1] = kind
    a.changes[#a.changes + 1] = value
  end
end

local function flush_events(a, set)
  local changes = a.changes
  if not changes or #changes == 0 then return end
  local stream = string.sub(a.m, 1, -2) .. 'v'
  for first = 1, #changes, 2 * EVENT_PAIRS do
    a.evn = a.evn + 1
    redis.call('XADD', stream, 'MAXLEN', '~', EVENT_ENTRIES, '*', 'n', fmt(a.evn),
      unpack(changes, first, math.min(#changes, first + 2 * EVENT_PAIRS - 1)))
  end
  a.changes = nil
  set[#set + 1] = 'evn'
  set[#set + 1] = fmt(a.evn)
end

local function flush(a)
  local set = {}
  for _, name in ipairs(GAUGES) do
    set[#set + 1] = name
    set[#set + 1] = fmt(a[name])
  end
  flush_events(a, set)
  redis.call('HSET', a.m, unpack(set))
  for _, name in ipairs(COUNTERS) do
    if a.d[name] ~= 0 then redis.call('HINCRBY', a.m, name, a.d[name]) end
  end
end

-- -- free extents (best fit, coalescing; the memory index's SlotAllocator) ----------------

local function free_insert(a, off, size)
  local o = fmt(off)
  redis.call('HSET', a.fo, o, fmt(size))
  redis.call('HSET', a.fe, fmt(off + size), o)
  redis.call('ZADD', a.fs, fmt(size), o)
  a.free = a.free + size
end

local function free_remove(a, off, size)
  local o = fmt(off)
  redis.call('HDEL', a.fo, o)
  redis.call('HDEL', a.fe, fmt(off + size))
  redis.call('ZREM', a.fs, o)
  a.free = a.free - size
end

local function free_take(a, size)
  local r = redis.call('ZRANGEBYSCORE', a.fs, fmt(size), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if #r == 0 then return nil end
  local off, extent = tonumber(r[1]), tonumber(r[2])
  free_remove(a, off, extent)
  if extent > size then free_insert(a, off + size, extent - size) end
  return off
end

local function free_give(a, off, size)
  local before = redis.call('HGET', a.fe, fmt(off))
  if before then
    before = tonumber(before)
    free_remove(a, before, off - before)
    size, off = size + off - before, before
  end
  local after = redis.call('HGET', a.fo, fmt(off + size))
  if after then
    after = tonumber(after)
    free_remove(a, off + size, after)
    size = size + after
  end
  free_insert(a, off, size)
end

local function largest_free(a)
  local r = redis.call('ZRANGE', a.fs, -1, -1, 'WITHSCORES')
  if #r == 0 then return 0 end
  return tonumber(r[2])
end

-- -- occupied and retired slots -----------------------------------------------------------

local function occ_pack(size, kind, state, retention, key, extra)
  return struct.pack('<I8BBI4', size, kind, state, retention) .. key .. (extra or '')
end

local function occ_parse(off, v)
  local size, kind, state, retention = struct.unpack('<I8BBI4', v)
  return {off = off, size = size, kind = kind, state = state, retention = retention,
          key = string.sub(v, 15, 46), extra = string.sub(v, 47)}
end

local function occ_add(a, off, size, kind, state, key, extra)
  redis.call('HSET', a.o, fmt(off), occ_pack(size, kind, state, 0, key, extra))
  redis.call('HSET', a.oe, fmt(off + size), fmt(off))
end

local function occ_get(a, off)
  local v = redis.call('HGET', a.o, fmt(off))
  if not v then return nil end
  return occ_parse(off, v)
end

-- The occupant of an entry follows its state and retention (what eviction prices).
local function occ_follow(a, key, e)
  local oc = occ_get(a, e.off)
  if oc and oc.kind == OCC_ENTRY and oc.key == key then
    redis.call('HSET', a.o, fmt(e.off),
      occ_pack(oc.size, OCC_ENTRY, e.state, e.retention, key, oc.extra))
  end
end

local function occ_del(a, off, size)
  redis.call('HDEL', a.o, fmt(off))
  redis.call('HDEL', a.oe, fmt(off + size))
end

-- A slot whose record may still be read waits out the grace period before it is free again.
local function retire(a, off, size, now, immediate)
  if immediate or a.grace <= 0 then
    -- While the node reports its records nothing is free: restore_done computes free space.
    if not a.restoring then free_give(a, off, size) end
    return
  end
  local tok = redis.call('HINCRBY', a.m, 'tok', 1)
  local due = now + a.grace
  redis.call('HSET', a.r, fmt(off), struct.pack('<I8I8d', size, tok, due))
  redis.call('HSET', a.re, fmt(off + size), fmt(off))
  redis.call('ZADD', a.rq, fmt(due), fmt(off) .. ':' .. fmt(tok))
  a.retired = a.retired + size
end

local function release(a, off, tok)
  local v = redis.call('HGET', a.r, fmt(off))
  if not v then return 0 end
  local size, held = struct.unpack('<I8I8', v)
  if tok and held ~= tok then return 0 end
  redis.call('HDEL', a.r, fmt(off))
  redis.call('HDEL', a.re, fmt(off + size))
  redis.call('ZREM', a.rq, fmt(off) .. ':' .. fmt(held))
  a.retired = a.retired - size
  if not a.restoring then free_give(a, off, size) end
  return size
end

local function release_due(a, now)
  local due = redis.call('ZRANGEBYSCORE', a.rq, '-inf', fmt(now), 'LIMIT', 0, 1000)
  for _, member in ipairs(due) do
    local off, tok = string.match(member, '^(%d+):(%d+)$')
    redis.call('ZREM', a.rq, member)
    release(a, tonumber(off), tonumber(tok))
  end
end

-- -- entries --------------------------------------------------------------------------------

local function version_bytes(counter, lo)
  return struct.pack('<I4I4', (counter % 1048576) * 4096 + lo, math.floor(counter / 1048576))
end

local WIRE = 76  -- bytes of a descriptor
local ENTRY = '<c32I4I4I8I8c8c8I4BI4'

local function entry_get(a, key)
  local v = redis.call('GET', a.e .. key)
  if not v then return nil end
  local k, node, region, off, len, rkey, ver, crc, state, retention = struct.unpack(ENTRY, v)
  return {key = k, node = node, region = region, off = off, len = len, rkey = rkey, ver = ver,
          crc = crc, state = state, retention = retention, tail = string.sub(v, WIRE + 6)}
end

local function entry_pack(e)
  return struct.pack(ENTRY, e.key, e.node, e.region, e.off, e.len, e.rkey, e.ver, e.crc,
    e.state, e.retention) .. (e.tail or '')
end

local function entry_set(a, key, e)
  redis.call('SET', a.e .. key, entry_pack(e))
end

-- An entry's record is let go: its slot here retires (or is free at once: immediate); for a
-- record another arena holds, returns what that arena must release (nothing when that arena
-- is not known: a copy promoted in place of an invalid one).
local function let_go(a, key, e, now, immediate)
  if e.state == FOREIGN then
    local host = struct.unpack('<I8', e.tail)
    if host == 0 then return nil end
    return {fmt(host), fmt(e.off), key, e.ver}
  end
  local oc = occ_get(a, e.off)
  if oc and oc.kind == OCC_ENTRY and oc.key == key then
    occ_del(a, e.off, oc.size)
    retire(a, e.off, oc.size, now, immediate)
  end
  return nil
end

-- Take an entry out. Its slot retires (or is free at once: immediate). For an entry whose
-- record lives in another arena, returns what that arena must release.
local function remove_entry(a, key, e, now, immediate)
  if e.state == FOREIGN then redis.call('SREM', a.x, key) end
  redis.call('DEL', a.e .. key)
  if e.state ~= PENDING then tell(a, 'r', key) end
  if e.state == PENDING then
    a.n_pend = a.n_pend - 1
    redis.call('ZREM', a.pq, fmt(e.off))
  else
    a.n_pub = a.n_pub - 1
    a.payload = a.payload - e.len
  end
  return let_go(a, key, e, now, immediate)
end

local function expire_leases(a, now)
  local due = redis.call('ZRANGEBYSCORE', a.pq, '-inf', fmt(now), 'LIMIT', 0, 1000)
  for _, member in ipairs(due) do
    local off = tonumber(member)
    redis.call('ZREM', a.pq, member)
    local oc = occ_get(a, off)
    if oc and oc.kind == OCC_ENTRY then
      local e = entry_get(a, oc.key)
      if e and e.state == PENDING and e.off == off then
        -- Redis expires the key at the same instant; at the boundary, do it now.
        redis.call('DEL', a.e .. oc.key)
        e = nil
      end
      if not e or e.off ~= off then
        occ_del(a, off, oc.size)
        retire(a, off, oc.size, now, false)
        a.n_pend = a.n_pend - 1
        bump(a, 'lease_expiries')
      end
    end
  end
end

-- -- eviction: LRU weighted by retention, over a sample, in windows that fit ----------------

local function age(a, key)
  local ok, idle = pcall(redis.call, 'OBJECT', 'IDLETIME', a.e .. key)
  if ok then return idle end
  -- An LFU maxmemory-policy keeps no idle clock: a low access frequency reads as old.
  local fine, freq = pcall(redis.call, 'OBJECT', 'FREQ', a.e .. key)
  if fine then return 255 - freq end
  return 0
end

local function weight(retention)
  if retention < 1 then retention = 1 end
  return 1 + math.log(retention) / math.log(2)
end

-- What keeping an occupant is worth (nil: it cannot be evicted: a grant being written, or a
-- record claimed while its node reports them).
local function keep_value(a, oc, now, cache)
  local known = cache[oc.off]
  if known ~= nil then return known or nil end
  local value = false
  if oc.kind == OCC_ENTRY then
    if oc.state == PUBLISHED then
      value = weight(oc.retention) / (age(a, oc.key) + 1e-3)
    end
  elseif oc.kind == OCC_HOSTED and not a.restoring then
    -- A restored record whose entry lives in its key's arena: as old as its restore.
    local _, _, since = struct.unpack('<I8c8d', oc.extra)
    value = 1 / ((now - since) / 1000 + 1e-3)
  end
  cache[oc.off] = value
  return value or nil
end

local function evict_occupant(a, off, now, immediate, notices)
  local oc = occ_get(a, off)
  if not oc then return end
  if oc.kind == OCC_ENTRY then
    local e = entry_get(a, oc.key)
    if e then remove_entry(a, oc.key, e, now, immediate) end
  else
    local home, ver = struct.unpack('<I8c8', oc.extra)
    occ_del(a, off, oc.size)
    retire(a, off, oc.size, now, immediate)
    notices[#notices + 1] = {fmt(home), fmt(off), oc.key, ver}
  end
  bump(a, 'evictions')
end

-- The contiguous window of at least `need` bytes around the slot at `seed` (free extents,
-- retired slots and evictable occupants), priced by what it evicts; nil if none.
local function plan(a, seed, need, now, cache)
  local victims, retired, cost = {}, {}, 0
  local stop = a.base + a.size
  local function step(off, forward)
    local start, oc
    if forward then
      local f = redis.call('HGET', a.fo, fmt(off))
      if f then return off + tonumber(f) end
      local r = redis.call('HGET', a.r, fmt(off))
      if r then
        retired[#retired + 1] = off
        return off + struct.unpack('<I8', r)
      end
      oc = occ_get(a, off)
      if not oc then return nil end
      start = off
    else
      local s = redis.call('HGET', a.fe, fmt(off))
      if s then return tonumber(s) end
      s = redis.call('HGET', a.re, fmt(off))
      if s then
        retired[#retired + 1] = tonumber(s)
        return tonumber(s)
      end
      s = redis.call('HGET', a.oe, fmt(off))
      if not s then return nil end
      start = tonumber(s)
      oc = occ_get(a, start)
      if not oc then return nil end
    end
    local value = keep_value(a, oc, now, cache)
    if not value then return nil end
    victims[#victims + 1] = start
    cost = cost + value
    if forward then return start + oc.size end
    return start
  end
  local low = seed
  local high = step(seed, true)
  if not high then return nil end
  while high - low < need do
    local moved = nil
    if high < stop then moved = step(high, true) end
    if moved then
      high = moved
    else
      if low > a.base then moved = step(low, false) end
      if not moved then return nil end
      low = moved
    end
  end
  return {cost = cost, victims = victims, retired = retired}
end

-- Occupants of a random sample, the least worth keeping first.
local function sample(a, now, cache)
  local offs = redis.call('HRANDFIELD', a.o, SAMPLE)
  local scored = {}
  for _, o in ipairs(offs) do
    local oc = occ_get(a, tonumber(o))
    if oc then
      local value = keep_value(a, oc, now, cache)
      if value then scored[#scored + 1] = {oc.off, value} end
    end
  end
  table.sort(scored, function(x, y) return x[2] < y[2] end)
  return scored
end

local function evict_one(a, now, immediate, notices)
  local scored = sample(a, now, {})
  if #scored == 0 then return false end
  evict_occupant(a, scored[1][1], now, immediate, notices)
  return true
end

-- Make a value of `size` bytes fit: evict the cheapest window around the stalest sampled
-- entries and the oldest retired slots (retired slots in it are reused before their grace
-- ends: a put is never refused for a grace period). When no window can grow big enough
-- (grants being written block it), the stalest entry goes and the search runs again.
local function make_room(a, size, now, notices)
  for _ = 1, 1000 do
    if largest_free(a) >= size then return end
    local cache, best = {}, nil
    local scored = sample(a, now, cache)
    for i = 1, math.min(#scored, SEEDS) do
      local pl = plan(a, scored[i][1], size, now, cache)
      if pl and (not best or pl.cost < best.cost) then best = pl end
    end
    local oldest = redis.call('ZRANGE', a.rq, 0, SEEDS - 1)
    for _, member in ipairs(oldest) do
      local off = tonumber(string.match(member, '^(%d+):'))
      local pl = plan(a, off, size, now, cache)
      if pl and (not best or pl.cost < best.cost) then best = pl end
    end
    if best then
      for _, off in ipairs(best.victims) do evict_occupant(a, off, now, true, notices) end
      for _, off in ipairs(best.retired) do
        if release(a, off, nil) > 0 then bump(a, 'early_reuse') end
      end
      return
    end
    if not evict_one(a, now, true, notices) then return end
  end
end

-- Keep `headroom` of the arena free or on its way to free, so writers rarely wait.
local function keep_headroom(a, now, notices)
  local target = math.floor(a.size * a.headroom)
  for _ = 1, 256 do
    if a.free + a.retired >= target then return end
    if not evict_one(a, now, false, notices) then return end
    release_due(a, now)
  end
end

local function upkeep(a, now)
  expire_leases(a, now)
  release_due(a, now)
end

-- -- reads (no writes: they replicate nothing) -----------------------------------------------

local function mget(prefix, keys, from)
  local names = {}
  for i = from, #keys do names[#names + 1] = prefix .. keys[i] end
  if #names <= BATCH then return redis.call('MGET', unpack(names)) end
  local out = {}
  for start = 1, #names, BATCH do
    local got = redis.call('MGET', unpack(names, start, math.min(#names, start + BATCH - 1)))
    for j = 1, #got do out[#out + 1] = got[j] end
  end
  return out
end

-- ARGV: keys. Returns 1 and every key's entry as it is (nil where there is none): the
-- client keeps the published ones and takes each one's descriptor, which the entry starts
-- with. The client slices them, not this function: Redis's single thread is the part every
-- client shares.
local function lookup(keys, args)
  if redis.call('EXISTS', keys[1]) == 0 then return {false} end
  return {1, mget(string.sub(keys[1], 1, -2) .. 'e:', args, 1)}
end

local function exists(keys, args)
  if redis.call('EXISTS', keys[1]) == 0 then return {false} end
  local values = mget(string.sub(keys[1], 1, -2) .. 'e:', args, 1)
  local out = {1}
  for i = 1, #args do
    local v = values[i]
    if v and string.byte(v, WIRE + 1) ~= PENDING then out[#out + 1] = 1 else out[#out + 1] = 0 end
  end
  return out
end

local function stats(keys, args)
  local all = redis.call('HGETALL', keys[1])
  if #all == 0 then return {false} end
  return all
end

-- -- writes ---------------------------------------------------------------------------------

-- ARGV: lease_ms, grace_ms, headroom, then (key, length, slot size) per request.
-- Returns 'ok', evictions, {kind per key}, {entry per key or ''}, {notices}.
local function allocate(a, args)
  local now, now_us = clock()
  upkeep(a, now)
  local notices, kinds, entries = {}, {}, {}
  local evicted_before = a.d.evictions
  for i = 4, #args, 3 do
    local key, len, size = args[i], tonumber(args[i + 1]), tonumber(args[i + 2])
    local kind, entry = NO_SPACE, ''
    local e = entry_get(a, key)
    if e then
      if e.state == PENDING then
        kind = IN_FLIGHT
        bump(a, 'in_flight')
      else
        e.retention = e.retention + 1
        entry_set(a, key, e)
        if e.state == PUBLISHED then occ_follow(a, key, e) end
        kind, entry = EXISTS, redis.call('GET', a.e .. key)
        bump(a, 'dedup_hits')
      end
    elseif a.restoring then
      bump(a, 'no_space')
    elseif size > a.size then
      -- It could never fit: refuse it without evicting anything for it.
      bump(a, 'no_space')
      bump(a, 'oversize')
    else
      local off = free_take(a, size)
      if not off then
        make_room(a, size, now, notices)
        off = free_take(a, size)
      end
      if not off then
        bump(a, 'no_space')
      else
        a.vc = math.max(a.vc + 1, now_us)
        entry = entry_pack({key = key, node = a.node, region = a.region, off = off, len = len,
          rkey = a.rkey8, ver = version_bytes(a.vc, a.lo), crc = 0, state = PENDING,
          retention = 0})
        redis.call('SET', a.e .. key, entry, 'PX', fmt(math.max(1, a.lease_ms)))
        occ_add(a, off, size, OCC_ENTRY, PENDING, key)
        redis.call('ZADD', a.pq, fmt(now + a.lease_ms), fmt(off))
        a.n_pend = a.n_pend + 1
        kind = GRANTED
        bump(a, 'grants')
      end
    end
    kinds[#kinds + 1] = kind
    entries[#entries + 1] = entry
  end
  keep_headroom(a, now, notices)
  return {'ok', a.d.evictions - evicted_before, kinds, entries, notices}
end

-- ARGV: (key, version, crc, alternates) per grant; kvf1_publish_described adds each
-- grant's encoded engine block (or '') for the KV events. Returns a flag per grant.
local function publish_items(a, args, stride)
  local out = {}
  for i = 1, #args, stride do
    local key, ver = args[i], args[i + 1]
    local e = entry_get(a, key)
    if e and e.state == PENDING and e.ver == ver then
      e.state, e.crc, e.retention = PUBLISHED, tonumber(args[i + 2]), 1
      e.tail = args[i + 3]
      entry_set(a, key, e)  -- a plain SET: the lease's expiry goes with it
      occ_follow(a, key, e)
      redis.call('ZREM', a.pq, fmt(e.off))
      a.n_pend = a.n_pend - 1
      a.n_pub = a.n_pub + 1
      a.payload = a.payload + e.len
      bump(a, 'published')
      tell(a, 's', stride == 5 and key .. args[i + 4] or key)
      out[#out + 1] = 1
    else
      bump(a, 'publish_rejected')
      out[#out + 1] = 0
    end
  end
  return {'ok', out}
end

local function publish(a, args)
  return publish_items(a, args, 4)
end

local function publish_described(a, args)
  return publish_items(a, args, 5)
end

-- An entry's alternates, and what precedes them in its tail (a foreign entry's holder).
local function alternates_of(e)
  if e.state == FOREIGN then return string.sub(e.tail, 9), string.sub(e.tail, 1, 8) end
  return e.tail or '', ''
end

-- ARGV: most alternates an entry keeps, then (key, version or '', alternates) per key:
-- the published entry (of that version) lists these copies first, then those it listed on
-- other nodes, up to the most. Returns how many entries changed.
local function link(keys, args)
  local a = open(keys)
  if not a then return {'gone'} end
  local most, changed = tonumber(args[1]), 0
  for i = 2, #args, 3 do
    local e = entry_get(a, args[i])
    if e and e.state ~= PENDING and (args[i + 1] == '' or e.ver == args[i + 1]) then
      local alts, head = alternates_of(e)
      local add = args[i + 2]
      for j = 0, #add / WIRE - 1 do
        local copy = string.sub(add, j * WIRE + 1, (j + 1) * WIRE)
        local node = string.sub(copy, 33, 36)
        if node ~= struct.pack('<I4', e.node) then
          -- The new copy first: a listed copy on a node since lost must not keep it out.
          local kept = copy
          for m = 0, #alts / WIRE - 1 do
            local other = string.sub(alts, m * WIRE + 1, (m + 1) * WIRE)
            if string.sub(other, 33, 36) ~= node then kept = kept .. other end
          end
          alts = string.sub(kept, 1, most * WIRE)
        end
      end
      e.tail = head .. alts
      entry_set(a, args[i], e)
      changed = changed + 1
    end
  end
  return {'ok', changed}
end

-- ARGV: grace_ms, then (key, version) per grant.
local function abort(a, args)
  local now = clock()
  for i = 2, #args, 2 do
    local key = args[i]
    local e = entry_get(a, key)
    if e and e.state == PENDING and e.ver == args[i + 1] then
      -- A write may still be landing in the slot: retire it, do not free it.
      remove_entry(a, key, e, now, false)
      bump(a, 'aborted')
    end
  end
  return {'ok'}
end

-- The entry's own copy goes (invalid, or its record let go) and its first alternate is read
-- first from now on: the entry becomes one whose record another arena holds (which one is
-- not known here: 0). Returns what the old record's holder must release, if anything.
local function promote(a, key, e, now)
  local notice = let_go(a, key, e, now, false)
  local alts = alternates_of(e)
  local first = string.sub(alts, 1, WIRE)
  redis.call('SET', a.e .. key, first .. struct.pack('<BI4I8', FOREIGN, e.retention, 0)
    .. string.sub(alts, WIRE + 1))
  redis.call('SADD', a.x, key)
  bump(a, 'replicas_dropped')
  return notice
end

-- ARGV: grace_ms, counter name, then (key, version or '') per key: removes published entries
-- (with that version, if given: then an entry with other copies keeps the key, its next
-- copy promoted; an entry that only lists a copy of that version among its alternates drops
-- it from the list). Returns 'ok', how many went (entries or listed copies), {notices}.
local function unpublish(a, args)
  local now = clock()
  local removed, notices = 0, {}
  for i = 3, #args, 2 do
    local key, ver = args[i], args[i + 1]
    local e = entry_get(a, key)
    if e and e.state ~= PENDING and (ver == '' or e.ver == ver) then
      local notice
      if ver ~= '' and #(alternates_of(e)) >= WIRE then
        notice = promote(a, key, e, now)
      else
        notice = remove_entry(a, key, e, now, false)
      end
      if notice then notices[#notices + 1] = notice end
      removed = removed + 1
    elseif e and e.state ~= PENDING and #e.tail > 0 then
      local alts, head = alternates_of(e)
      for j = 0, #alts / WIRE - 1 do
        if string.sub(alts, j * WIRE + 65, j * WIRE + 72) == ver then
          e.tail = head .. string.sub(alts, 1, j * WIRE) .. string.sub(alts, (j + 1) * WIRE + 1)
          entry_set(a, key, e)
          bump(a, 'replicas_dropped')
          removed = removed + 1
          break
        end
      end
    end
  end
  bump(a, args[2], removed)
  return {'ok', removed, notices}
end

-- ARGV: grace_ms. Lease expiry and retired slots coming back.
local function tick(a, args)
  upkeep(a, clock())
  return {'ok'}
end

-- -- arena lifecycle ------------------------------------------------------------------------

-- Deletes up to DROP_BATCH of an arena's occupants and foreign entries (``notices``, when
-- given, gets one per record held here for an entry elsewhere); returns how many are left,
-- and deletes the arena's other keys once none is.
local function clear_batch(p, notices)
  local dropped = 0
  local offs = redis.call('HRANDFIELD', p .. 'o', DROP_BATCH)
  for _, o in ipairs(offs) do
    local oc = occ_parse(tonumber(o), redis.call('HGET', p .. 'o', o))
    if oc.kind == OCC_ENTRY then
      dropped = dropped + redis.call('DEL', p .. 'e:' .. oc.key)
    elseif notices then
      local home, ver = struct.unpack('<I8c8', oc.extra)
      notices[#notices + 1] = {fmt(home), o, oc.key, ver}
    end
    redis.call('HDEL', p .. 'o', o)
  end
  local foreign = redis.call('SPOP', p .. 'x', DROP_BATCH)
  for _, key in ipairs(foreign) do redis.call('DEL', p .. 'e:' .. key) end
  local left = redis.call('HLEN', p .. 'o') + redis.call('SCARD', p .. 'x')
  if left == 0 then
    redis.call('DEL', p .. 'fo', p .. 'fe', p .. 'fs', p .. 'oe', p .. 'r', p .. 're',
      p .. 'rq', p .. 'p', p .. 'cz', p .. 'v')
  end
  return left, dropped
end

-- ARGV: node, region, base, size, rkey, id, lo, restoring, rkey as 8 bytes, the birth of
-- the registry that lists the arena. Idempotent for one registry. Returns 1 (made), 0 (not
-- made: there already, or left to whoever clears what is there), or 2 (a batch of what an
-- older registry's arena under this id left was cleared: call again).
--
-- Arena ids start again with a registry made afresh (a Redis restarted empty), and an
-- initialisation read from the old registry can reach the new Redis after the restart: it
-- makes the old arena (another node's, or not restoring) under an id the new registry then
-- gives to another arena. So the registry listing the id now wins: an arena an older one
-- made is cleared and made again (under the key ``c``, the newer birth, until it is), one
-- a newer one made is left as it is. An arena is made only on a clean slate: what a drop
-- is still deleting is left to it (it sends the notices).
local function init(keys, args)
  -- A caller that passes no birth counts as 0, older than any registry.
  args[10] = args[10] or '0'
  local born = tonumber(args[10])
  local p = string.sub(keys[1], 1, -2)
  if redis.call('EXISTS', keys[1]) == 1 then
    if tonumber(redis.call('HGET', keys[1], 'born') or '0') >= born then return 0 end
    redis.call('DEL', keys[1])
    redis.call('SET', p .. 'c', args[10])
  end
  local clearing = tonumber(redis.call('GET', p .. 'c') or '0')
  if clearing > born then return 0 end
  if clearing == 0 and redis.call('HLEN', p .. 'o') + redis.call('SCARD', p .. 'x') > 0 then
    return 0
  end
  if clear_batch(p, nil) > 0 then return 2 end
  redis.call('DEL', p .. 'c')
  redis.call('HSET', keys[1], 'node', args[1], 'region', args[2], 'base', args[3],
    'size', args[4], 'rkey', args[5], 'id', args[6], 'lo', args[7], 'restoring', args[8],
    'rkey8', args[9], 'born', args[10],
    'free', '0', 'retired', '0', 'n_pub', '0', 'n_pend', '0', 'payload', '0', 'vc', '0',
    'tok', '0')
  if args[8] ~= '1' then
    local a = open(keys)
    free_insert(a, a.base, a.size)
    flush(a)
  end
  return 1
end

-- ARGV: (none). Deletes the arena a batch at a time: the meta key goes first, so every
-- function sees the arena gone at once. Returns how many entries went, how many occupants
-- are left, and notices for records of this arena whose entries live elsewhere.
local function drop(keys, args)
  local p = string.sub(keys[1], 1, -2)
  redis.call('DEL', keys[1])
  local notices = {}
  local left, dropped = clear_batch(p, notices)
  return {dropped, left, notices}
end

-- ARGV: grace_ms, then (offset, key, version) per record this arena holds for an entry that
-- lived in another arena and is gone: its slot retires.
local function release_hosted(a, args)
  local now = clock()
  for i = 2, #args, 3 do
    local oc = occ_get(a, tonumber(args[i]))
    if oc and oc.kind == OCC_HOSTED and oc.key == args[i + 1] then
      local _, ver = struct.unpack('<I8c8', oc.extra)
      if ver == args[i + 2] then
        occ_del(a, oc.off, oc.size)
        redis.call('ZREM', a.cz, fmt(oc.off))
        retire(a, oc.off, oc.size, now, false)
      end
    end
  end
  return {'ok'}
end

-- -- restore: a node reports the records it holds ----------------------------------------------

-- On the arena holding the records. ARGV: align, then (offset, size, key, home arena,
-- version) per record. Returns a flag per record: its slot is claimed.
local function claim(a, args)
  local now = clock()
  local align = tonumber(args[1])
  local out = {}
  for i = 2, #args, 5 do
    local off, size = tonumber(args[i]), tonumber(args[i + 1])
    local ok = a.restoring and off >= a.base and off % align == 0
      and off + size <= a.base + a.size
    if ok then
      local at = redis.call('ZRANGEBYSCORE', a.cz, fmt(off), fmt(off + size - 1), 'LIMIT', 0, 1)
      local before = redis.call('ZREVRANGEBYSCORE', a.cz, fmt(off), '-inf', 'LIMIT', 0, 1)
      if #at > 0 and tonumber(at[1]) == off then
        ok = false
        bump(a, 'restore_duplicates')
      elseif #at > 0 then
        ok = false
        bump(a, 'restore_overlaps')
      elseif #before > 0 then
        local prev = occ_get(a, tonumber(before[1]))
        if prev and prev.off + prev.size > off then
          ok = false
          bump(a, 'restore_overlaps')
        end
      end
    end
    if ok then
      occ_add(a, off, size, OCC_HOSTED, PUBLISHED, args[i + 2],
        struct.pack('<I8c8d', tonumber(args[i + 3]), args[i + 4], now))
      redis.call('ZADD', a.cz, fmt(off), fmt(off))
      out[#out + 1] = 1
    else
      out[#out + 1] = 0
    end
  end
  return {'ok', out}
end

-- On each key's arena. ARGV: (key, node, region, rkey bytes, offset, length, version, crc,
-- holding arena) per claimed record. A key already here (published or being written) is
-- refused: a key found twice is kept once. Returns a flag per record: published.
local function adopt(a, args)
  local out = {}
  for i = 1, #args, 9 do
    local key, off, len = args[i], tonumber(args[i + 4]), tonumber(args[i + 5])
    local ver, crc, holder = args[i + 6], tonumber(args[i + 7]), tonumber(args[i + 8])
    local oc = holder == a.id and occ_get(a, off)
    if redis.call('EXISTS', a.e .. key) == 1 then
      bump(a, 'restore_duplicates')
      out[#out + 1] = 0
    elseif holder == a.id and not (oc and oc.kind == OCC_HOSTED and oc.key == key) then
      out[#out + 1] = 0  -- its claim is gone (the arena was reset meanwhile)
    else
      if holder == a.id then
        redis.call('HSET', a.o, fmt(off), occ_pack(oc.size, OCC_ENTRY, PUBLISHED, 1, key))
        redis.call('SET', a.e .. key, entry_pack({key = key, node = a.node, region = a.region,
          off = off, len = len, rkey = a.rkey8, ver = ver, crc = crc, state = PUBLISHED,
          retention = 1}))
      else
        redis.call('SET', a.e .. key, entry_pack({key = key, node = tonumber(args[i + 1]),
          region = tonumber(args[i + 2]), off = off, len = len, rkey = args[i + 3], ver = ver,
          crc = crc, state = FOREIGN, retention = 1, tail = struct.pack('<I8', holder)}))
        redis.call('SADD', a.x, key)
      end
      a.n_pub = a.n_pub + 1
      a.payload = a.payload + len
      bump(a, 'restored')
      tell(a, 's', key)
      out[#out + 1] = 1
    end
  end
  return {'ok', out}
end

-- On the arena holding the records. ARGV: (offset, key) per claimed record that was not
-- published: its claim goes (the space was never granted: restore_done counts it free).
local function unclaim(keys, args)
  local a = open(keys)
  if not a then return {'gone'} end
  for i = 1, #args, 2 do
    local oc = occ_get(a, tonumber(args[i]))
    if oc and oc.kind == OCC_HOSTED and oc.key == args[i + 1] then
      occ_del(a, oc.off, oc.size)
      redis.call('ZREM', a.cz, fmt(oc.off))
    end
  end
  return {'ok'}
end

-- The node reported everything: free space is what no record or retired slot holds.
local function restore_done(keys, args)
  local a = open(keys)
  if not a then return {'gone'} end
  if not a.restoring then return {'ok'} end
  local used = {}
  local occupied = redis.call('HGETALL', a.o)
  for i = 1, #occupied, 2 do
    used[#used + 1] = {tonumber(occupied[i]), (struct.unpack('<I8', occupied[i + 1]))}
  end
  local retired = redis.call('HGETALL', a.r)
  for i = 1, #retired, 2 do
    used[#used + 1] = {tonumber(retired[i]), (struct.unpack('<I8', retired[i + 1]))}
  end
  table.sort(used, function(x, y) return x[1] < y[1] end)
  a.restoring = false
  local cursor = a.base
  for _, slot in ipairs(used) do
    if slot[1] > cursor then free_insert(a, cursor, slot[1] - cursor) end
    cursor = math.max(cursor, slot[1] + slot[2])
  end
  if a.base + a.size > cursor then free_insert(a, cursor, a.base + a.size - cursor) end
  redis.call('HSET', a.m, 'restoring', '0')
  redis.call('DEL', a.cz)
  flush(a)
  return {'ok'}
end

-- -- the registry of a namespace (KEYS[1] = '{NS}:next') -----------------------------------------

local function registry_prefix(keys)
  return string.sub(keys[1], 1, -5)
end

-- ARGV: name. The node's id: assigned once per name, never given to another name.
local function node_id(keys, args)
  local R = registry_prefix(keys)
  local id = redis.call('HGET', R .. 'ids', args[1])
  if id then return tonumber(id) end
  id = redis.call('HINCRBY', keys[1], 'node', 1)
  redis.call('HSET', R .. 'ids', args[1], fmt(id))
  return id
end

-- ARGV: id, restoring, arena_size, align, ttl_ms, node info, instance, then (region, size,
-- rkey) per region. A new incarnation; arenas of unchanged regions are kept, the others
-- replaced. A name whose node is alive (its liveness key stands) and was registered by
-- another process (instance) is refused: {'in-use', ms left}. Returns 'ok', incarnation,
-- epoch, {created arena ids}, {dropped arena ids}.
local function register(keys, args)
  local R = registry_prefix(keys)
  local id, restoring = args[1], args[2] == '1'
  local arena_size, align, ttl = tonumber(args[3]), tonumber(args[4]), tonumber(args[5])
  local instance = args[7]
  local held_by = redis.call('HGET', R .. 'instance', id)
  if held_by and held_by ~= instance then
    local left = redis.call('PTTL', R .. 'alive:' .. id)
    if left > 0 then return {'in-use', left} end
  end
  redis.call('HSET', R .. 'instance', id, instance)
  -- A registry created afresh (a Redis restarted without persistence) is told apart by
  -- when it was born, and its incarnations start from that time: a client never mistakes
  -- a node of the new registry for one it knew under the same id.
  local _, now_us = clock()
  if redis.call('HSETNX', keys[1], 'born', fmt(now_us)) == 1 then
    redis.call('HSET', keys[1], 'incarnation', fmt(now_us))
  end
  local inc = redis.call('HINCRBY', keys[1], 'incarnation', 1)
  redis.call('HSET', R .. 'nodes', id, args[6])
  redis.call('HSET', R .. 'inc', id, fmt(inc))
  redis.call('HSET', R .. 'ttl', id, fmt(ttl))
  local mine = {}
  local held = redis.call('HGETALL', R .. 'na:' .. id)
  for i = 1, #held, 2 do mine[held[i]] = held[i + 1] end
  local created, keep = {}, {}
  for i = 8, #args, 3 do
    local region, rkey = args[i], args[i + 2]
    local size = tonumber(args[i + 1])
    size = size - size % align
    local n = math.max(1, math.ceil(size / arena_size))
    local piece = math.floor(size / n / align) * align
    if piece == 0 then n, piece = 1, size end
    for k = 0, n - 1 do
      local base = k * piece
      local this = piece
      if k == n - 1 then this = size - base end
      local identity = region .. ':' .. k
      local spec = table.concat({id, region, fmt(k), fmt(base), fmt(this), rkey}, '|')
      local arena = mine[identity]
      local record = arena and redis.call('HGET', R .. 'arenas', arena)
      if this > 0 then
        if arena and record and not restoring and string.sub(record, 1, #spec + 1) == spec .. '|'
        then
          keep[identity] = arena
        else
          local new = fmt(redis.call('HINCRBY', keys[1], 'arena', 1))
          redis.call('HSET', R .. 'arenas', new, spec .. '|' .. (restoring and '1' or '0'))
          keep[identity] = new
          created[#created + 1] = new
        end
      end
    end
  end
  local dropped = {}
  for identity, arena in pairs(mine) do
    if keep[identity] ~= arena then
      redis.call('HDEL', R .. 'arenas', arena)
      redis.call('SADD', R .. 'dropped', arena)
      dropped[#dropped + 1] = arena
    end
  end
  redis.call('DEL', R .. 'na:' .. id)
  for identity, arena in pairs(keep) do redis.call('HSET', R .. 'na:' .. id, identity, arena) end
  if ttl > 0 then
    redis.call('SET', R .. 'alive:' .. id, fmt(inc), 'PX', fmt(ttl))
  else
    redis.call('DEL', R .. 'alive:' .. id)
  end
  local epoch = redis.call('HINCRBY', keys[1], 'epoch', 1)
  return {'ok', inc, epoch, created, dropped}
end

-- ARGV: id. Forget a node (its name keeps its id). Returns 1 and {dropped arena ids}, or 0.
local function remove(keys, args)
  local R = registry_prefix(keys)
  local id = args[1]
  if redis.call('HDEL', R .. 'nodes', id) == 0 then return {0, {}} end
  redis.call('HDEL', R .. 'inc', id)
  redis.call('HDEL', R .. 'ttl', id)
  redis.call('HDEL', R .. 'instance', id)
  local held = redis.call('HGETALL', R .. 'na:' .. id)
  local dropped = {}
  for i = 2, #held, 2 do
    redis.call('HDEL', R .. 'arenas', held[i])
    redis.call('SADD', R .. 'dropped', held[i])
    dropped[#dropped + 1] = held[i]
  end
  redis.call('DEL', R .. 'na:' .. id, R .. 'alive:' .. id)
  redis.call('HINCRBY', keys[1], 'epoch', 1)
  return {1, dropped}
end

-- ARGV: the epoch and birth the caller knows. Returns the epoch alone if unchanged, else the
-- epoch, {id, incarnation, info}..., {arena id, record}..., {dropped arena ids}, birth.
local function registry(keys, args)
  local R = registry_prefix(keys)
  local epoch = tonumber(redis.call('HGET', keys[1], 'epoch') or '0')
  local born = redis.call('HGET', keys[1], 'born') or '0'
  if args[1] and tonumber(args[1]) == epoch and args[2] == born then return {epoch} end
  local nodes = redis.call('HGETALL', R .. 'nodes')
  local out = {}
  for i = 1, #nodes, 2 do
    out[#out + 1] = nodes[i]
    out[#out + 1] = redis.call('HGET', R .. 'inc', nodes[i]) or '0'
    out[#out + 1] = nodes[i + 1]
  end
  return {epoch, out, redis.call('HGETALL', R .. 'arenas'), redis.call('SMEMBERS', R .. 'dropped'),
    born}
end

-- ARGV: id, incarnation. The node is alive for its TTL more; 0 if that incarnation is not
-- the registered one (the node must register again).
local function heartbeat(keys, args)
  local R = registry_prefix(keys)
  if redis.call('HGET', R .. 'inc', args[1]) ~= args[2] then return 0 end
  local ttl = tonumber(redis.call('HGET', R .. 'ttl', args[1]) or '0')
  if ttl > 0 then redis.call('SET', R .. 'alive:' .. args[1], args[2], 'PX', fmt(ttl)) end
  return 1
end

-- Nodes whose liveness key expired (registered with a TTL and silent since).
local function silent(keys, args)
  local R = registry_prefix(keys)
  local ttls = redis.call('HGETALL', R .. 'ttl')
  local out = {}
  for i = 1, #ttls, 2 do
    if tonumber(ttls[i + 1]) > 0 and redis.call('EXISTS', R .. 'alive:' .. ttls[i]) == 0 then
      out[#out + 1] = ttls[i]
    end
  end
  return out
end

-- ARGV: id, incarnation, the node's record as registered less its restoring flag. The node
-- reported its records (its arenas took them): the registry lists it, and its arenas, as not
-- restoring, so an arena made again from the registry (its keys lost with a shard) takes
-- grants at once. 0 when that incarnation is not the registered one.
local function restored(keys, args)
  local R = registry_prefix(keys)
  local id = args[1]
  if redis.call('HGET', R .. 'inc', id) ~= args[2] then return 0 end
  redis.call('HSET', R .. 'nodes', id, args[3])
  for _, arena in ipairs(redis.call('HVALS', R .. 'na:' .. id)) do
    local record = redis.call('HGET', R .. 'arenas', arena)
    if record and string.sub(record, -2) == '|1' then
      redis.call('HSET', R .. 'arenas', arena, string.sub(record, 1, -2) .. '0')
    end
  end
  redis.call('HINCRBY', keys[1], 'epoch', 1)
  return 1
end

-- ARGV: arena ids whose keys are all deleted.
local function forget_dropped(keys, args)
  local R = registry_prefix(keys)
  for _, arena in ipairs(args) do redis.call('SREM', R .. 'dropped', arena) end
  return 1
end

-- Every registry key of the namespace goes (arenas are dropped before, one by one).
local function purge(keys, args)
  local R = registry_prefix(keys)
  local ids = redis.call('HVALS', R .. 'ids')
  for _, id in ipairs(ids) do redis.call('DEL', R .. 'na:' .. id, R .. 'alive:' .. id) end
  redis.call('DEL', R .. 'ids', R .. 'nodes', R .. 'inc', R .. 'ttl', R .. 'instance',
    R .. 'arenas', R .. 'dropped', keys[1])
  return 1
end

-- A function on one arena gets it opened (KEYS[1] is its meta hash) with the arguments, and
-- its gauges and counters are written back after it ran; an arena that is not there
-- (replaced, dropped, or not made yet) answers {'gone'}. `settings`: 'lease' when the
-- arguments start with lease_ms, grace_ms and headroom (allocation), 'grace' when they start
-- with grace_ms (the function retires slots).
-- A relay wants KV events of this arena for ARGV[1] ms more (it asks again well before
-- then). Returns 'ok' and the entries written so far, or 'gone'.
local function events_on(keys, args)
  if redis.call('EXISTS', keys[1]) == 0 then return {'gone'} end
  local now = clock()
  redis.call('HSET', keys[1], 'ev', fmt(now + tonumber(args[1])))
  return {'ok', redis.call('HGET', keys[1], 'evn') or '0'}
end

local function arena_function(name, body, settings)
  redis.register_function(name, function(keys, args)
    local a
    if settings == 'lease' then
      a = open(keys, args[1], args[2], args[3])
    elseif settings == 'grace' then
      a = open(keys, '0', args[1], '0')
    else
      a = open(keys)
    end
    if not a then return {'gone'} end
    local reply = body(a, args)
    flush(a)
    return reply
  end)
end

local function ro(name, callback)
  redis.register_function{function_name = name, callback = callback, flags = {'no-writes'}}
end

ro('kvf1_lookup', lookup)
ro('kvf1_exists', exists)
ro('kvf1_stats', stats)
ro('kvf1_registry', registry)
ro('kvf1_silent', silent)
arena_function('kvf1_allocate', allocate, 'lease')
arena_function('kvf1_publish', publish)
arena_function('kvf1_publish_described', publish_described)
redis.register_function('kvf1_events_on', events_on)
redis.register_function('kvf1_link', link)
arena_function('kvf1_abort', abort, 'grace')
arena_function('kvf1_unpublish', unpublish, 'grace')
arena_function('kvf1_tick', tick, 'grace')
redis.register_function('kvf1_init', init)
redis.register_function('kvf1_drop', drop)
arena_function('kvf1_release_hosted', release_hosted, 'grace')
arena_function('kvf1_claim', claim)
arena_function('kvf1_adopt', adopt)
redis.register_function('kvf1_unclaim', unclaim)
redis.register_function('kvf1_restore_done', restore_done)
redis.register_function('kvf1_node_id', node_id)
redis.register_function('kvf1_register', register)
redis.register_function('kvf1_remove', remove)
redis.register_function('kvf1_heartbeat', heartbeat)
redis.register_function('kvf1_forget_dropped', forget_dropped)
redis.register_function('kvf1_restored', restored)
redis.register_function('kvf1_purge', purge)
