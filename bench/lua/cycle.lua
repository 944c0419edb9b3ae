-- Cycle through prepared raw requests (replays of keys already stored, or any
-- scenario whose requests Python built ahead: signed webhooks, redeliveries).
-- Arg: a file of records "<byte length>\n<raw HTTP request>".
local requests = {}
local i = 0
local threads = {}

function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  local f = assert(io.open(args[1], "rb"))
  local data = f:read("*a")
  f:close()
  local pos = 1
  while pos <= #data do
    local nl = string.find(data, "\n", pos, true)
    local len = tonumber(string.sub(data, pos, nl - 1))
    table.insert(requests, string.sub(data, nl + 1, nl + len))
    pos = nl + len + 1
  end
  -- Threads start at different offsets, so they do not send in lockstep.
  i = ((tid or 1) - 1) * 7919 % #requests
end

function request()
  i = i % #requests + 1
  return requests[i]
end
