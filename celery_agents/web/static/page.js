// The approvals page's only script: redraw the live part of a page from the server, count down
// to each deferred call's deadline, and check an edited call's arguments are JSON before they post.
// A session page redraws when its Server-Sent Events say something happened, and shows the model's
// answer as it streams (`text_delta`, `reasoning_delta`) until its step commits; the list of
// pending calls redraws every few seconds. Nothing is redrawn while you are deciding in a form.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) { return; }
  var refreshUrl = live.getAttribute("data-refresh");
  var eventsUrl = live.getAttribute("data-events");
  var timer = null;
  // When the countdowns' `data-left` (seconds, by the server's clock) were drawn: this browser's
  // clock may be wrong, its elapsed time is not.
  var drawnAt = performance.now();

  // A person deciding: focus in one of the forms, text typed into one, an editor or a confirmation
  // opened. Redrawing then would throw their words away.
  function busy() {
    var el = document.activeElement;
    if (el && live.contains(el) && el.closest("form, details.edit, details.confirm")) { return true; }
    if (live.querySelector("details.edit[open], details.confirm[open]")) { return true; }
    var fields = live.querySelectorAll("textarea, input[type=text]");
    for (var i = 0; i < fields.length; i++) {
      if (fields[i].value !== fields[i].defaultValue) { return true; }
    }
    var boxes = live.querySelectorAll("input[type=checkbox]");
    for (var j = 0; j < boxes.length; j++) {
      if (boxes[j].checked !== boxes[j].defaultChecked) { return true; }
    }
    return false;
  }

  function redraw() {
    timer = null;
    if (busy()) { schedule(1000); return; }
    fetch(refreshUrl, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null || busy()) { return; }
        // Server-rendered and escaped by the server; the CSP forbids inline script besides.
        live.innerHTML = html;
        drawnAt = performance.now();
        tick();
        document.dispatchEvent(new CustomEvent("agents:redrawn"));
      })
      .catch(function () {});
  }

  function schedule(ms) {
    if (timer === null) { timer = window.setTimeout(redraw, ms); }
  }

  // The same words as page.py `_left`.
  function left(seconds) {
    var s = Math.floor(seconds);
    if (s <= 0) { return "deadline passed"; }
    if (s < 3600) { return Math.floor(s / 60) + " min " + (s % 60) + " s left"; }
    if (s < 86400) { return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min left"; }
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h left";
  }

  function tick() {
    var elapsed = (performance.now() - drawnAt) / 1000;
    var clocks = document.querySelectorAll(".countdown[data-left]");
    for (var i = 0; i < clocks.length; i++) {
      var rest = parseFloat(clocks[i].getAttribute("data-left")) - elapsed;
      clocks[i].textContent = left(rest);
      clocks[i].classList.toggle("soon", rest < 3600);
    }
  }
  window.setInterval(tick, 1000);

  // An edited call's arguments must be a JSON object: say so at once instead of posting. The
  // server checks them again, and against the tool's schema.
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (!form.classList || !form.classList.contains("edit-form")) { return; }
    var editor = form.querySelector("textarea[name=arguments]");
    var problem = form.querySelector(".edit-problem");
    var message = "";
    try {
      var value = JSON.parse(editor.value);
      if (value === null || typeof value !== "object" || Array.isArray(value)) {
        message = "The arguments must be a JSON object: { … }.";
      }
    } catch (e) {
      message = "That is not JSON: " + e.message;
    }
    editor.setAttribute("aria-invalid", message ? "true" : "false");
    if (problem) { problem.textContent = message; }
    if (message) {
      event.preventDefault();
      editor.focus();
    }
  });

  // The answer streaming now, by kind; drawn after the transcript, as text (never as HTML).
  var streaming = { text: "", reasoning: "" };
  var lastDelta = "";

  function drawStreaming() {
    var list = live.querySelector("ol.transcript");
    if (!list) { return; }
    ["reasoning", "text"].forEach(function (kind) {
      var item = list.querySelector("li.streaming." + kind);
      if (!streaming[kind]) {
        if (item) { item.remove(); }
        return;
      }
      if (!item) {
        item = document.createElement("li");
        item.className = "msg streaming " + kind + (kind === "text" ? " model" : " reasoning");
        var who = document.createElement("span");
        who.className = "who";
        who.textContent = kind === "text" ? "model (writing…)" : "thinking…";
        var body = document.createElement("div");
        body.className = "text";
        item.appendChild(who);
        item.appendChild(body);
        if (kind === "reasoning") {
          var textItem = list.querySelector("li.streaming.text");
          list.insertBefore(item, textItem);
        } else {
          list.appendChild(item);
        }
      }
      item.querySelector(".text").textContent = streaming[kind];
    });
  }

  function onDelta(event) {
    var kind = event.type === "text_delta" ? "text" : "reasoning";
    var offset = event.offset || 0;
    if (offset < streaming[kind].length) { streaming = { text: "", reasoning: "" }; }  // it starts again
    streaming[kind] = streaming[kind].slice(0, offset) + event.text;
    lastDelta = event.id;
    drawStreaming();
  }

  document.addEventListener("agents:redrawn", drawStreaming);

  // Stream ids `<ms>-<seq>`: is `a` after `b`?
  function after(a, b) {
    var x = String(a).split("-"), y = String(b).split("-");
    var dx = Number(x[0]) - Number(y[0]);
    return dx > 0 || (dx === 0 && Number(x[1]) > Number(y[1]));
  }

  if (eventsUrl && window.EventSource) {
    var source = new EventSource(eventsUrl);
    source.onmessage = function (message) {
      var event = null;
      try { event = JSON.parse(message.data); } catch (e) { event = null; }
      if (event && (event.type === "text_delta" || event.type === "reasoning_delta")) {
        onDelta(event);
        return;
      }
      if (event && (event.type === "llm_called" || event.type === "model_interrupted" ||
          (event.type === "step_started" && lastDelta && after(event.id, lastDelta)))) {
        streaming = { text: "", reasoning: "" };  // committed (the redraw shows it) or dropped
      }
      schedule(150);
    };
  } else if (refreshUrl) {
    window.setInterval(function () { schedule(0); }, 5000);
  }
})();
