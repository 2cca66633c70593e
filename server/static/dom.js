// Small pieces of the page that every view builds with: elements by id, tokens in running
// text, errors, notes, pickers and check boxes.

export const $ = (id) => document.getElementById(id);

// How a token is shown: visible whitespace in charts, raw text in the running output.
export const visible = (text) => text.replace(/\n/g, "↵").replace(/ /g, "␣") || "∅";

// A number to `digits` places, never "-0.00".
export const fixed = (value, digits = 2) => (Math.abs(value) < 0.5 * 10 ** -digits ? 0 : value).toFixed(digits);

// A token in running text: a newline shows as ↵ before the line break, and the token can be
// reached with Tab and explained with Enter (its title is also its accessible name).
export function tokenSpan(text, title, background) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = text.replace(/\n/g, "↵\n");
  span.title = title;
  span.style.background = background;
  return span;
}

export function clickable(span, action) {
  span.tabIndex = 0;
  span.setAttribute("role", "button");
  span.setAttribute("aria-label", `${visible(span.textContent)}: ${span.title}`);
  span.addEventListener("click", action);
  span.addEventListener("keydown", (event) => {
    if (event.key === "Enter" || event.key === " ") { event.preventDefault(); action(); }
  });
}

export function showError(container, error) {
  const message = document.createElement("div");
  message.className = "error";
  message.textContent = error.message;
  container.append(message);
}

// The width a chart can take inside `element`, less `margin`: what a hidden view would have
// (0) reads as `otherwise`.
export const room = (element, margin, otherwise) => (element.clientWidth || otherwise) - margin;

export function note(text) {
  const paragraph = document.createElement("p");
  paragraph.className = "note";
  paragraph.textContent = text;
  return paragraph;
}

export function fillSelect(select, count, what) {
  const previous = Number(select.value || 0);
  select.replaceChildren(...Array.from({ length: count }, (_, i) => new Option(`${what} ${i}`, String(i))));
  select.value = String(previous < count ? previous : 0);
}

export function checkbox(text, data, name) {
  const label = document.createElement("label");
  label.className = "check";
  const box = document.createElement("input");
  box.type = "checkbox";
  for (const [key, value] of Object.entries(data)) box.dataset[key] = String(value);
  if (name) box.setAttribute("aria-label", name);
  label.append(box, text);
  return label;
}
