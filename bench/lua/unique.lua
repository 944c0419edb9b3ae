-- Each request carries a key never sent before: run id, thread number, counter.
-- Args: the raw request template file; the template holds @@KEY@@ where the key
-- goes (in a header or in the body: keys have a fixed length, so the
-- Content-Length computed for the template stays right).
local threads = {}
local counter = 0
local template, run  -- tid is a global, set per thread by setup()

function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  local f = assert(io.open(args[1], "rb"))
  template = f:read("*a")
  f:close()
  run = args[2]
end

function request()
  counter = counter + 1
  -- run (8 chars) - thread (2) - counter (10): always 22 characters.
  local key = string.format("%s-%02d-%010d", run, tid, counter)
  return (string.gsub(template, "@@KEY@@", key))
end
