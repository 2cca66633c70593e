// Talking to the server: JSON calls, a streamed completion (Server-Sent Events), and the API
// key. The page talks only to this server: /v1/models, /v1/tokenize, /v1/completions, /v1/trace,
// /v1/patch and /v1/geometry.

export class ServerError extends Error {}

// A server started with ORDINAL_API_KEY wants `Authorization: Bearer KEY` on /v1/*: the page
// asks for the key once (on the first 401) and keeps it for this tab only.
const KEY_STORAGE = "ordinal-api-key";

export async function call(path, options = {}) {
  const key = sessionStorage.getItem(KEY_STORAGE);
  const headers = { ...(options.headers ?? {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
  const response = await fetch(path, { ...options, headers });
  if (response.status !== 401) return response;
  const entered = window.prompt("This ordinal server needs its API key:");
  if (!entered) return response;
  sessionStorage.setItem(KEY_STORAGE, entered.trim());
  return call(path, options);
}

export async function post(path, body, signal) {
  return answer(await call(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  }));
}

export async function get(path) {
  return answer(await call(path));
}

async function answer(response) {
  const data = await response.json();
  if (!response.ok) throw new ServerError(data.error ? data.error.message : response.statusText);
  return data;
}

// Yields each `data:` payload of a streamed completion (parsed), until [DONE].
export async function* streamCompletion(body, signal) {
  const response = await call("/v1/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!response.ok) {
    const data = await response.json();
    throw new ServerError(data.error ? data.error.message : response.statusText);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ")) continue;
      const payload = event.slice(6);
      if (payload === "[DONE]") return;
      const data = JSON.parse(payload);
      if (data.error) throw new ServerError(data.error.message);
      yield data;
    }
  }
}
